"""The engine core actor's link to its CPU tier: attach, lookups, store offers and releases.

The pure ``OffloadConnector`` fills an outbox as the scheduler runs; ``flush`` takes it through
the engine core's ``OffloadPort`` (the link's one door to the core) and sends it. Lookups
and offers are requests to ``subjects.tier_in(cpu_tier_id)`` answered in background tasks, so
the step loop never waits on the tier: a reply is fed back to the connector (a looked-up request
returns to the waiting queue) and wakes the loop. A lookup that fails or takes longer than
``kv_lookup_timeout_s`` is a miss (the request recomputes); an offer without an answer is
dropped. Releases (keys loaded, stored, failed) are published without a reply, and so, every
``RENEW_INTERVAL_S``, is a renewal of the keys this engine core still holds (``TierRenew``), so
the tier's leases run out only for a silent engine core: a slot is never reused under a load or
a store still to be copied, however long a request waits for admission.

Attach: the engine core sends its KV layout once its workers described themselves; until a
tier answers, offload stays off (requests recompute) and the link retries in the background. A
reply from a different region generation, or a refusal (a restarted tier has no region), makes
it attach again; a lookup refused so is asked again once attached.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from shoal.bus.base import Bus
from shoal.bus.codec import Codec, encode
from shoal.bus.errors import BusError
from shoal.bus.messages.offload import (
    DTYPE_SIZES,
    KVLayout,
    TierAttach,
    TierAttached,
    TierError,
    TierLookup,
    TierLookupReply,
    TierPrepareStore,
    TierReply,
    TierStoreSlots,
)
from shoal.bus.messages.worker import WorkerInfo
from shoal.bus.runtime.actor import call
from shoal.bus.subjects import Subjects
from shoal.config.deployment import ShoalConfig
from shoal.engine.core.offload_port import OffloadPort

log = logging.getLogger(__name__)

ATTACH_RETRY_S = 2.0
RENEW_INTERVAL_S = 5.0  # well within a CPU tier's lease (30 s by default)
_REPLY: Codec[TierReply] = Codec(TierReply)


def kv_layout(config: ShoalConfig, infos: Sequence[WorkerInfo]) -> KVLayout:
    """The chunk layout of an engine core whose workers reported ``infos``; its model tag names
    the checkpoint and everything that shapes its KV bytes or its keys. With
    ``canonical_layout`` it names every KV head of the model in one part, not the
    tensor-parallel size, so deployments of the model at any TP size share it. ``ValueError``
    when the workers did not report their KV geometry."""
    info = infos[0]
    if info.num_layers < 1 or info.kv_dtype not in DTYPE_SIZES:
        raise ValueError(f"worker {info.worker_id} did not report its KV cache geometry")
    model, transfer = config.model_config, config.kv_transfer_config
    num_kv_heads, tp_size = info.num_kv_heads, info.tp_size
    if transfer.canonical_layout:
        if info.total_kv_heads < 1:
            raise ValueError(f"worker {info.worker_id} did not report its model's KV heads")
        num_kv_heads, tp_size = info.total_kv_heads, 1
    shape = (
        model.model,
        info.num_layers,
        info.block_size,
        num_kv_heads,
        info.head_dim,
        info.kv_dtype,
        tp_size,
        transfer.blocks_per_chunk,
        config.cache_config.prefix_caching_hash_algo,
        *(("canonical",) if transfer.canonical_layout else ()),
    )
    digest = hashlib.sha256(repr(shape).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", model.name.rstrip("/").rsplit("/", 1)[-1])[:48]
    return KVLayout(
        model_tag=f"{name or 'model'}-{digest}",
        num_layers=info.num_layers,
        block_size=info.block_size,
        num_kv_heads=num_kv_heads,
        head_dim=info.head_dim,
        dtype=info.kv_dtype,
        tp_size=tp_size,
        blocks_per_chunk=transfer.blocks_per_chunk,
        canonical=transfer.canonical_layout,
    )


class OffloadLink:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        config: ShoalConfig,
        owner: str,
        wake: Callable[[], None],
    ) -> None:
        """``wake()`` nudges the step loop after a reply changed what it can schedule."""
        self.bus = bus
        self.config = config.kv_transfer_config
        self.subject = subjects.tier_in(self.config.cpu_tier_id)
        self.owner = owner
        self._port: OffloadPort | None = None  # the engine core's door, once attached
        self._wake = wake
        self._layout: KVLayout | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._attaching: asyncio.Task[None] | None = None
        self._renewing: asyncio.Task[None] | None = None

    def attach(self, layout: KVLayout, port: OffloadPort) -> None:
        """Attach (again) in the background, for the engine core behind ``port``; renew what
        it holds from then on."""
        self._layout, self._port = layout, port
        self._attach_again()

    def _attach_again(self) -> None:
        if self._layout is None:  # stopped
            return
        if self._attaching is None or self._attaching.done():
            self._attaching = asyncio.create_task(self._attach(), name=f"attach-{self.owner}")
        if self._renewing is None:
            self._renewing = asyncio.create_task(self._renew(), name=f"renew-{self.owner}")

    async def _renew(self) -> None:
        """Every ``RENEW_INTERVAL_S``: tell the tier which pins and stores this engine core still
        holds (a lookup answered but not loaded yet, a load or a store not copied yet). A
        failure is logged and the renewals go on: a lapse would let the tier reuse those
        slots under a live engine core."""
        while True:
            await asyncio.sleep(RENEW_INTERVAL_S)
            try:
                renewal = self._port.renewal(self.owner) if self._port is not None else None
                if renewal is not None:
                    await self._publish(encode(renewal))
            except Exception:
                log.exception("%s: renewing the offload leases failed", self.owner)

    async def _attach(self) -> None:
        while self._layout is not None:
            try:
                reply = await call(
                    self.bus,
                    self.subject,
                    TierAttach(self._layout),
                    _REPLY,
                    timeout=self.config.kv_lookup_timeout_s,
                )
            except (BusError, TimeoutError) as exc:
                log.info("%s: CPU tier %s not attached (%r)", self.owner, self.subject, exc)
            else:
                if isinstance(reply, TierAttached):
                    if self._port is not None:
                        self._port.attached(reply.region)
                        log.info("%s: KV offload to %s", self.owner, reply.region.path)
                        return
                else:
                    log.error("%s: CPU tier refused the attach: %r", self.owner, reply)
            await asyncio.sleep(ATTACH_RETRY_S)

    def flush(self) -> None:
        """Send what the connector queued: lookups, store offers, releases."""
        if self._port is None:
            return
        outbox = self._port.take_outbox(self.owner)
        for request_id, lookup_id, keys, tiers in outbox.lookups:
            self._spawn(self._lookup(request_id, lookup_id, keys, tiers))
        for job_id, keys in outbox.offers:
            self._spawn(self._offer(job_id, keys))
        if outbox.release is not None:
            self._spawn(self._publish(encode(outbox.release)))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _request(self, message: TierLookup | TierPrepareStore) -> TierReply | None:
        try:
            reply = await call(
                self.bus, self.subject, message, _REPLY, timeout=self.config.kv_lookup_timeout_s
            )
        except Exception as exc:  # a lost, slow or failing tier: a miss
            log.debug("%s: %s to the CPU tier failed: %r", self.owner, type(message).__name__, exc)
            return None
        if isinstance(reply, TierError) and self._layout is not None:
            # Typically a restarted tier that has no region yet: attach to it again.
            log.info("%s: the CPU tier refused a request (%s); attaching again", self.owner, reply)
            self._attach_again()
        return reply

    async def _lookup(
        self, request_id: str, lookup_id: int, keys: list[bytes], tiers: list[str] | None
    ) -> None:
        reply: TierReply | None = None
        lookup = TierLookup(self.owner, keys, tiers)
        try:
            reply = await self._request(lookup)
            if isinstance(reply, TierError) and await self._attached_again():
                reply = await self._request(lookup)  # the restarted tier
        finally:  # whatever happened, the request leaves the parking
            if self._port is not None:
                answer = reply if isinstance(reply, TierLookupReply) else None
                if answer is not None:
                    self._check_generation(answer.generation)
                self._port.lookup_answered(request_id, lookup_id, keys, answer)
                self._wake()
                self.flush()  # a stale answer's pins go back at once

    async def _offer(self, job_id: int, keys: list[bytes]) -> None:
        reply = await self._request(TierPrepareStore(self.owner, keys))
        if self._port is None:
            return
        slots = reply if isinstance(reply, TierStoreSlots) else None
        if slots is not None:
            self._check_generation(slots.generation)
        self._port.store_answered(job_id, slots)
        self._wake()
        self.flush()

    async def _attached_again(self) -> bool:
        """Wait (at most a lookup's timeout) for the attach a refusal started; attached?"""
        attaching = self._attaching
        if attaching is not None and not attaching.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(attaching), self.config.kv_lookup_timeout_s)
        return attaching is not None and attaching.done() and not attaching.cancelled()

    def _check_generation(self, generation: str) -> None:
        region = self._port.region if self._port is not None else None
        if region is not None and generation != region.generation:
            log.info("%s: the CPU tier restarted; attaching to its new region", self.owner)
            self._attach_again()

    async def _publish(self, data: bytes) -> None:
        try:
            await self.bus.publish(self.subject, data)
        except BusError as exc:
            log.debug("%s: release to the CPU tier lost: %r", self.owner, exc)

    async def stop(self) -> None:
        self._layout = None
        tasks = [*self._tasks, *(t for t in (self._attaching, self._renewing) if t is not None)]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
