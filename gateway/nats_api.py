"""The gateway's public NATS request/reply API: ``Subjects.api_generate()`` in the queue group
``Subjects.api_queue()``, so several gateways share the load.

A request (``GenerateRequest``, JSON or msgpack) is answered on its reply subject with one
``result``, or with ``chunk`` messages ending in a ``final`` one (``stream: true``). A failure is
one ``error`` message with the same code and status as on the HTTP API. Messages carry the
bus's streamed-reply headers (``Shoal-Stream: more|last|error``, ``Shoal-Error: <code>``), so
``bus.streams.request_stream`` reads them as well as a plain nats-py client does. A message on
``Subjects.api("cancel")`` with ``{"request_id": ...}`` stops that request on whichever gateway
runs it. Schema and example: ``docs/nats-api.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator

import msgspec

from shoal.bus.base import (
    ERROR_CODE_HEADER,
    STREAM_ERROR,
    STREAM_HEADER,
    Bus,
    ReplyStream,
    Subscription,
)
from shoal.bus.msg import Msg
from shoal.bus.subjects import Subjects
from shoal.engine.client.interface import EngineClientInterface
from shoal.engine.client.outputs import RequestOutput
from shoal.gateway.embedding_options import EmbeddingOptions
from shoal.gateway.embeddings import EmbeddingRequest, embed
from shoal.gateway.errors import ApiError, internal_error, unavailable
from shoal.gateway.generation import Generation
from shoal.gateway.lora_adapters import LoRAAdapters
from shoal.gateway.metrics import Metrics
from shoal.gateway.nats_replies import (
    ReplyBuilder,
    WireFormat,
    check_model,
    request_params,
    request_prompt,
)
from shoal.gateway.nats_schema import (
    JSON_CONTENT_TYPE,
    GenerateChunk,
    GenerateError,
    GenerateFinal,
    GenerateRequest,
    GenerateResult,
)

log = logging.getLogger(__name__)
Outputs = AsyncGenerator[tuple[int, RequestOutput], None]


class CancelRequest(msgspec.Struct):
    request_id: str


class NatsApi:
    """Serves generate requests arriving on the bus with one engine client."""

    def __init__(
        self,
        bus: Bus,
        engine: EngineClientInterface,
        *,
        subjects: Subjects | None = None,
        served_model_name: str | None = None,
        metrics: Metrics | None = None,
        trust_request_chat_template: bool = False,
        loras: LoRAAdapters | None = None,
        embeddings: EmbeddingOptions | None = None,
    ) -> None:
        self.bus = bus
        self.loras = loras or LoRAAdapters()
        self.embeddings = embeddings  # --runner pooling: the embeddings subject answers
        self.engine = engine
        self.trust_request_chat_template = trust_request_chat_template
        self.subjects = subjects or Subjects()
        self.served_model_name = served_model_name or engine.model_name
        self.metrics = metrics
        self.running: dict[str, asyncio.Task[None] | None] = {}
        self._subscriptions: list[Subscription] = []

    async def start(self) -> None:
        subjects = self.subjects
        queue = subjects.api_queue()
        self._subscriptions = [
            await self.bus.subscribe(subjects.api_generate(), self._on_generate, queue=queue),
            await self.bus.subscribe(subjects.api("cancel"), self._on_cancel),
            await self.bus.subscribe(subjects.api("embeddings"), self._on_embed, queue=queue),
        ]
        await self.bus.flush()  # the server knows the subscriptions once start returns

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop taking requests and cancel those running; returns once their callers have been
        sent the ``cancelled`` error (bounded), so the bus may be closed next."""
        running = [task for task in self.running.values() if task is not None]
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions = []
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=timeout_s)

    async def _on_cancel(self, msg: Msg) -> None:
        wire = WireFormat.of(msg)
        try:
            if wire.is_json:
                cancel = msgspec.json.decode(msg.data, type=CancelRequest)
            else:
                cancel = msgspec.msgpack.decode(msg.data, type=CancelRequest)
        except msgspec.DecodeError:
            return
        task = self.running.get(cancel.request_id)
        if task is not None:
            task.cancel()

    async def _on_embed(self, msg: Msg) -> None:
        """``/v1/embeddings`` over NATS: the same body, the same answer, in one reply."""
        if not msg.reply:
            return
        wire = WireFormat.of(msg)
        request_id = f"nats-{uuid.uuid4().hex}"
        try:
            body = wire.decode_as(msg.data, EmbeddingRequest)
            lora = check_model(body, self.served_model_name, self.loras)
            if not self.engine.is_ready():
                raise unavailable("no engine core is ready")
            model = self.served_model_name if lora is None else lora.lora_name
            answer = await embed(self.engine, body, self.embeddings, lora, model)
            await ReplyStream(msg).end(wire.encode(answer))
        except ApiError as error:
            await _reply_error(msg, wire, error, request_id)
        except Exception as error:
            await _reply_error(msg, wire, internal_error(error), request_id)

    async def _on_generate(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("generate request on %s has no reply subject: dropped", msg.subject)
            return
        wire = WireFormat.of(msg)
        request_id = f"nats-{uuid.uuid4().hex}"
        arrival_time = time.time()
        try:
            request = wire.decode_request(msg.data)
            request_id = request.request_id or request_id
            if request_id in self.running:
                raise ApiError(
                    400,
                    f"request id {request_id!r} is already running",
                    code="duplicate_request_id",
                    param="request_id",
                )
            self.running[request_id] = asyncio.current_task()
            try:
                await self._serve(msg, wire, request, request_id, arrival_time)
            finally:
                self.running.pop(request_id, None)
        except ApiError as error:
            await _reply_error(msg, wire, error, request_id)
        except asyncio.CancelledError:
            cancelled = ApiError(499, "the request was cancelled", code="cancelled")
            await _reply_error(msg, wire, cancelled, request_id)
        except Exception as error:
            await _reply_error(msg, wire, internal_error(error), request_id)

    async def _serve(
        self,
        msg: Msg,
        wire: WireFormat,
        request: GenerateRequest,
        request_id: str,
        arrival_time: float,
    ) -> None:
        lora = check_model(request, self.served_model_name, self.loras)
        prompt = request_prompt(request, self.engine, self.trust_request_chat_template)
        params = request_params(request, prompt, self.engine, wire.given_sampling_fields(msg.data))
        if not self.engine.is_ready():
            raise unavailable("no engine core is ready")
        builder = ReplyBuilder(params.n, len(prompt.token_ids), params.logprobs is not None)
        generation = Generation(
            self.engine, [prompt], [params], request_id, self.metrics, arrival_time, lora
        )
        async with generation:
            outputs = generation.outputs()
            async with contextlib.aclosing(outputs):
                model = self.served_model_name if lora is None else lora.lora_name
                if request.stream:
                    await self._stream(msg, wire, outputs, builder, (request_id, model))
                else:
                    await self._answer(msg, wire, outputs, builder, (request_id, model))

    async def _answer(
        self,
        msg: Msg,
        wire: WireFormat,
        outputs: Outputs,
        builder: ReplyBuilder,
        named: tuple[str, str],
    ) -> None:
        """``named``: the request's id and the model (or adapter) that answers."""
        async for _, output in outputs:
            for completion in output.outputs:
                builder.add(completion)
        result = GenerateResult(*named, builder.choices, builder.usage())
        await ReplyStream(msg).end(wire.encode(result))

    async def _stream(
        self,
        msg: Msg,
        wire: WireFormat,
        outputs: Outputs,
        builder: ReplyBuilder,
        named: tuple[str, str],
    ) -> None:
        """Chunks as outputs come; a failure part-way ends the stream with the error message."""
        request_id = named[0]
        stream = ReplyStream(msg)
        async for _, output in outputs:
            choices = [builder.add(completion) for completion in output.outputs]
            if choices:
                await stream.send(wire.encode(GenerateChunk(request_id, choices)))
        final = GenerateFinal(*named, builder.ends(), builder.usage())
        await stream.end(wire.encode(final))


async def _reply_error(msg: Msg, wire: WireFormat, error: ApiError, request_id: str) -> None:
    reply = GenerateError(error.to_response().error, error.status, request_id)
    headers = {STREAM_HEADER: STREAM_ERROR, ERROR_CODE_HEADER: error.code or "error"}
    if wire.is_json:
        headers["Content-Type"] = JSON_CONTENT_TYPE
    try:
        await msg.respond(wire.encode(reply), headers=headers)
    except Exception:  # the caller may be gone: nothing left to tell
        log.debug("could not deliver the error reply of %s", request_id, exc_info=True)
