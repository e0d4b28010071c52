"""The gateway's public NATS request/reply API, served in the queue group
``Subjects.api_queue()`` so several gateways share the load. Each operation is a subject,
``Subjects.api(<op>)``, and takes JSON or msgpack (answered in kind):

- ``generate`` (``GenerateRequest``): one ``result``, or ``chunk`` messages ending in a
  ``final`` one (``stream: true``);
- ``responses``, ``responses_get``, ``messages``, ``embeddings``: the HTTP API's
  ``/v1/responses``, ``GET /v1/responses/{id}``, Anthropic's ``/v1/messages`` and
  ``/v1/embeddings`` (same body, same answer, run by the same code on the same serving context),
  answered in one message, or streamed as one message per event;
- ``cancel`` with ``{"request_id": ...}`` stops that generate request on whichever gateway runs it.

A failure is one ``error`` message with the same code and status as on the HTTP API. Messages
carry the bus's streamed-reply headers (``Shoal-Stream: more|last|error``, ``Shoal-Error:
<code>``), so ``bus.streams.request_stream`` reads them as well as a plain nats-py client does.
Schema and example: ``docs/nats-api.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from shoal.bus.base import Bus, ReplyStream, Subscription
from shoal.bus.msg import Msg
from shoal.bus.subjects import API_CANCEL, API_OPERATIONS, Subjects
from shoal.engine.client.outputs import RequestOutput
from shoal.gateway.anthropic_messages import answer_message
from shoal.gateway.anthropic_types import MessagesRequest
from shoal.gateway.embeddings import EmbeddingRequest, embed
from shoal.gateway.errors import ApiError, internal_error
from shoal.gateway.generation import Generation
from shoal.gateway.nats_events import NatsEventStream, reply_error
from shoal.gateway.nats_replies import (
    ReplyBuilder,
    WireFormat,
    request_params,
    request_prompt,
)
from shoal.gateway.nats_schema import (
    GenerateChunk,
    GenerateFinal,
    GenerateRequest,
    GenerateResult,
)
from shoal.gateway.responses import respond, stored_response
from shoal.gateway.responses_types import ResponsesRequest
from shoal.gateway.serving import ServingContext
from shoal.gateway.tracing import serving_span

if TYPE_CHECKING:
    from shoal.tracing.tracer import ActorTracer

log = logging.getLogger(__name__)
Outputs = AsyncGenerator[tuple[int, RequestOutput], None]


class CancelRequest(msgspec.Struct):
    request_id: str


class GetResponseRequest(msgspec.Struct):
    response_id: str


@dataclass(slots=True)
class Exchange:
    """One request on the API: its message, wire format and request id (made up until the
    request names its own)."""

    msg: Msg
    wire: WireFormat
    request_id: str


Operation = Callable[[Exchange], Awaitable[None]]
StreamableBody = ResponsesRequest | MessagesRequest
# a Responses or Messages core: (context, body, arrival time, events or None) -> whole answer
Answer = Callable[..., Awaitable[Any]]


class NatsApi:
    """Serves the API's operations arriving on the bus with one serving context (the HTTP API's)."""

    def __init__(
        self,
        bus: Bus,
        ctx: ServingContext,
        *,
        subjects: Subjects | None = None,
        tracer: ActorTracer | None = None,
    ) -> None:
        """``tracer``: with ``--otlp-traces-endpoint``, the gateway's (a span per request, under
        the caller's ``traceparent`` message header when it sent one)."""
        self.bus = bus
        self.ctx = ctx
        self.subjects = subjects or Subjects()
        self.tracer = tracer
        self.running: dict[str, asyncio.Task[None] | None] = {}
        self._subscriptions: list[Subscription] = []

    async def start(self) -> None:
        subjects = self.subjects
        queue = subjects.api_queue()
        operations: dict[str, Operation] = {
            "generate": self._generate,
            "embeddings": self._embed,
            "responses": self._respond,
            "responses_get": self._get_response,
            "messages": self._message,
        }
        assert tuple(operations) == API_OPERATIONS, "every operation served, and only those"
        for name, operation in operations.items():
            handler = self._handler(name, operation)
            self._subscriptions.append(
                await self.bus.subscribe(subjects.api(name), handler, queue=queue)
            )
        cancels = await self.bus.subscribe(subjects.api(API_CANCEL), self._on_cancel)
        self._subscriptions.append(cancels)
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

    def _handler(self, name: str, operation: Operation) -> Callable[[Msg], Awaitable[None]]:
        tracer = self.tracer

        async def handle(msg: Msg) -> None:
            if tracer is None:
                await self._exchange(msg, operation)
                return
            with serving_span(tracer, f"nats {name}", msg.headers, {"shoal.api.operation": name}):
                await self._exchange(msg, operation)

        return handle

    async def _exchange(self, msg: Msg, operation: Operation) -> None:
        """Run one request's operation; any failure becomes its error reply."""
        if not msg.reply:
            log.warning("API request on %s has no reply subject: dropped", msg.subject)
            return
        exchange = Exchange(msg, WireFormat.of(msg), f"nats-{uuid.uuid4().hex}")
        try:
            await operation(exchange)
        except ApiError as error:
            await reply_error(msg, exchange.wire, error, exchange.request_id)
        except asyncio.CancelledError:
            cancelled = ApiError(499, "the request was cancelled", code="cancelled")
            await reply_error(msg, exchange.wire, cancelled, exchange.request_id)
        except Exception as error:
            await reply_error(msg, exchange.wire, internal_error(error), exchange.request_id)

    @contextlib.contextmanager
    def _running(self, exchange: Exchange, request_id: str | None = None) -> Iterator[None]:
        """Known as running under ``request_id`` (default: the exchange's) while inside: a
        cancel or ``stop`` reaches it."""
        request_id = exchange.request_id = request_id or exchange.request_id
        if request_id in self.running:
            raise ApiError(
                400,
                f"request id {request_id!r} is already running",
                code="duplicate_request_id",
                param="request_id",
            )
        self.running[request_id] = asyncio.current_task()
        try:
            yield
        finally:
            self.running.pop(request_id, None)

    # ----- the operations

    async def _embed(self, exchange: Exchange) -> None:
        """``/v1/embeddings``: the same body, the same answer, in one reply."""
        ctx, wire = self.ctx, exchange.wire
        body = wire.decode_as(exchange.msg.data, EmbeddingRequest)
        lora = ctx.check_model(body.model)
        ctx.check_ready()
        with self._running(exchange):
            answer = await embed(ctx.engine, body, ctx.embeddings, lora, ctx.model_name(lora))
        await ReplyStream(exchange.msg).end(wire.encode(answer))

    async def _respond(self, exchange: Exchange) -> None:
        """``POST /v1/responses``: the response, or its events one message each."""
        await self._answer_or_stream(exchange, ResponsesRequest, respond)

    async def _get_response(self, exchange: Exchange) -> None:
        """``GET /v1/responses/{id}``: ``{"response_id": ...}``, answered with the response."""
        wire = exchange.wire
        wanted = wire.decode_as(exchange.msg.data, GetResponseRequest)
        response = await stored_response(self.ctx, wanted.response_id)
        await ReplyStream(exchange.msg).end(wire.encode(response))

    async def _message(self, exchange: Exchange) -> None:
        """Anthropic's ``POST /v1/messages``: the message, or its events one message each."""
        await self._answer_or_stream(exchange, MessagesRequest, answer_message)

    async def _answer_or_stream(
        self, exchange: Exchange, body_type: type[StreamableBody], answer: Answer
    ) -> None:
        """Run ``answer`` (the HTTP handler's own core) on the decoded body: its whole answer
        in one reply, or (``stream``) its events one message each."""
        arrival_time = time.time()
        body = exchange.wire.decode_as(exchange.msg.data, body_type)
        with self._running(exchange):
            if body.stream:
                await answer(self.ctx, body, arrival_time, self._events(exchange))
                return
            whole = await answer(self.ctx, body, arrival_time)
        await ReplyStream(exchange.msg).end(exchange.wire.encode(whole))

    def _events(self, exchange: Exchange) -> NatsEventStream:
        return NatsEventStream(exchange.msg, exchange.wire, exchange.request_id)

    async def _generate(self, exchange: Exchange) -> None:
        arrival_time = time.time()
        msg, wire = exchange.msg, exchange.wire
        request = wire.decode_request(msg.data)
        with self._running(exchange, request.request_id):
            await self._serve(msg, wire, request, exchange.request_id, arrival_time)

    async def _serve(
        self,
        msg: Msg,
        wire: WireFormat,
        request: GenerateRequest,
        request_id: str,
        arrival_time: float,
    ) -> None:
        ctx = self.ctx
        lora = ctx.check_model(request.model)
        prompt = request_prompt(request, ctx.engine, ctx.trust_request_chat_template)
        params = request_params(request, prompt, ctx.engine, wire.given_sampling_fields(msg.data))
        ctx.check_ready()
        builder = ReplyBuilder(params.n, len(prompt.token_ids), params.logprobs is not None)
        generation = Generation(
            ctx.engine, [prompt], [params], request_id, ctx.metrics, arrival_time, lora
        )
        async with generation:
            outputs = generation.outputs()
            async with contextlib.aclosing(outputs):
                named = (request_id, ctx.model_name(lora))
                if request.stream:
                    await self._stream(msg, wire, outputs, builder, named)
                else:
                    await self._answer(msg, wire, outputs, builder, named)

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
