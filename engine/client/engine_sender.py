"""What the engine client sends to engine cores: the adds of a request (one per completion, with
the tokens it already has when resumed) and aborts, awaited or in the background, holding each
background task until it is done. Shared by ``AsyncEngineClient`` and ``EngineFaults``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from shoal.bus.base import Bus
from shoal.bus.codec import encode
from shoal.bus.errors import BusError
from shoal.bus.messages.engine import AbortRequest, AddRequest, KVTransferParams, ReleaseKV
from shoal.bus.subjects import Subjects
from shoal.engine.client.output_processor import ResumeRequest

log = logging.getLogger(__name__)


class EngineSender:
    """Sends one client's requests and aborts to engine cores over ``bus``."""

    def __init__(self, bus: Bus, subjects: Subjects, client_id: str) -> None:
        self.bus = bus
        self.subjects = subjects
        self.client_id = client_id
        self.eos_token_ids: list[int] = []  # the tokenizer's, set once it is read
        self._background: set[asyncio.Task[None]] = set()

    async def send_adds(
        self,
        engine_id: str,
        payload: ResumeRequest,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> None:
        """One add per completion of ``payload``, with the tokens it already has (resumed) or
        none, and the disaggregated prefill's ``kv_transfer_params``; a traced request's
        context rides in the message headers (W3C); ``BusError`` when one is not sent."""
        subject = self.subjects.engine_in(engine_id)
        for child, output_token_ids in payload.children:
            add = AddRequest(
                child.request_id,
                payload.prompt_token_ids,
                child.sampling_params,
                self.client_id,
                payload.arrival_time,
                eos_token_ids=self.eos_token_ids,
                priority=payload.priority,
                output_token_ids=output_token_ids,
                kv_transfer_params=kv_transfer_params,
                lora_request=payload.lora_request,
                pooling_params=payload.pooling_params,
            )
            await self.bus.publish(subject, encode(add), headers=payload.trace_headers)

    async def send_abort(self, engine_id: str, engine_request_ids: list[str]) -> None:
        """Abort these requests on ``engine_id`` (a lost abort is logged, not raised)."""
        try:
            await self.bus.publish(
                self.subjects.engine_in(engine_id), encode(AbortRequest(engine_request_ids))
            )
        except BusError as exc:
            log.warning("abort of %s not sent to %s: %r", engine_request_ids, engine_id, exc)

    async def send_release(self, engine_id: str, engine_request_ids: list[str]) -> None:
        """Free the KV ``engine_id`` holds for these requests' remote decodes (a lost release
        is logged, not raised: the hold's lease ends it)."""
        try:
            await self.bus.publish(
                self.subjects.engine_in(engine_id), encode(ReleaseKV(engine_request_ids))
            )
        except BusError as exc:
            log.warning("KV release of %s not sent to %s: %r", engine_request_ids, engine_id, exc)

    def abort_later(self, engine_id: str, engine_request_ids: list[str]) -> None:
        """Send an abort in the background (for callers that cannot await)."""
        self.spawn(self.send_abort(engine_id, engine_request_ids))

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run ``coroutine`` in the background, holding on to its task until it is done."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
