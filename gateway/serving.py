"""What the endpoint handlers share: the engine and served name, typed body decoding, the model
check, per-choice accumulation and usage, and server-sent events (``stream_events``) with
keep-alive comments while no output comes."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from shoal.bus.messages.lora import LoRARequest
from shoal.engine.client.interface import EngineClientInterface
from shoal.engine.client.outputs import CompletionOutput, RequestOutput
from shoal.gateway.embedding_options import EmbeddingOptions
from shoal.gateway.errors import ApiError, from_decode_error, internal_error, unavailable
from shoal.gateway.generation import Generation
from shoal.gateway.lora_adapters import LoRAAdapters
from shoal.gateway.metrics import Metrics
from shoal.gateway.request_types import decode_json_body
from shoal.gateway.response_store import ResponseStore
from shoal.gateway.response_types import Usage, make_usage
from shoal.gateway.tools import ToolCallingOptions

T = TypeVar("T")

DEFAULT_SSE_KEEP_ALIVE_S = 15.0
KEEP_ALIVE_EVENT = b": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see traffic
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


@dataclass(slots=True)
class ServingContext:
    engine: EngineClientInterface
    served_model_name: str
    metrics: Metrics
    sse_keep_alive_s: float | None = DEFAULT_SSE_KEEP_ALIVE_S  # None or 0: no keep-alive
    tool_calling: ToolCallingOptions = field(default_factory=ToolCallingOptions)
    trust_request_chat_template: bool = False  # a request may bring its own chat template
    loras: LoRAAdapters = field(default_factory=LoRAAdapters)  # served adapters, by name
    reasoning_parser: str | None = None  # --reasoning-parser: thinking split from the answer
    # vLLM's structured-outputs enable_in_reasoning: a grammar constrains the thinking too
    # (by default it starts after the thinking)
    structured_in_reasoning: bool = False
    embeddings: EmbeddingOptions | None = None  # --runner pooling: /v1/embeddings answers
    responses: ResponseStore = field(default_factory=ResponseStore)  # stored responses

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for a model
        this server does not have."""
        return self.loras.resolve(model, self.served_model_name)

    def model_name(self, lora: LoRARequest | None) -> str:
        """The name a response gives as its ``model``: the adapter's, or the served one."""
        return self.served_model_name if lora is None else lora.lora_name

    def check_ready(self) -> None:
        if not self.engine.is_ready():
            raise unavailable("no engine core is ready")


CONTEXT_KEY = web.AppKey("shoal_serving_context", ServingContext)


async def decode_body(request: web.Request, body_type: type[T]) -> T:
    """The JSON body as ``body_type`` (laxly, as ``decode_json_body`` says); malformed or
    mistyped input is a 400 naming the field."""
    raw = await request.read()
    try:
        return decode_json_body(raw, body_type)
    except msgspec.DecodeError as error:
        raise from_decode_error(error) from None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_seconds() -> int:
    return int(time.time())


@dataclass(slots=True)
class Choice:
    """One completion as it accumulates."""

    index: int
    texts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False

    def add(self, completion: CompletionOutput) -> None:
        if completion.text:
            self.texts.append(completion.text)
        self.num_tokens += len(completion.token_ids)
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason
            self.stop_reason = completion.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.texts)


class UsageCounter:
    """Prompt tokens once per prompt, completion tokens over every choice."""

    def __init__(self, prompt_lengths: list[int]) -> None:
        self.prompt_tokens = sum(prompt_lengths)
        self.completion_tokens = 0

    def add(self, completion: CompletionOutput) -> None:
        self.completion_tokens += len(completion.token_ids)

    def usage(self) -> Usage:
        return make_usage(self.prompt_tokens, self.completion_tokens)


class EventStream:
    """A server-sent event response: ``data: <json>`` per chunk, then ``data: [DONE]``.

    ``add`` buffers an event and ``flush`` writes the buffer in one go, so outputs that piled up
    while the client was being served leave in one write.
    """

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._buffer: list[bytes] = []
        self.response = web.StreamResponse(headers=SSE_HEADERS)

    @property
    def is_open(self) -> bool:
        """Whether the 200 and its headers have gone out (an error is then an event)."""
        return self.response.prepared

    async def open(self) -> None:
        if not self.response.prepared:
            await self.response.prepare(self._request)

    async def keep_alive(self) -> None:
        """A comment line, so proxies do not cut a stream that waits; opens the stream first."""
        await self.open()
        self._buffer.append(KEEP_ALIVE_EVENT)
        await self.flush()

    def add(self, chunk: Any) -> None:
        self._buffer.append(b"data: " + msgspec.json.encode(chunk) + b"\n\n")

    async def flush(self) -> None:
        if self._buffer:
            data = b"".join(self._buffer)
            self._buffer.clear()
            await self.response.write(data)

    async def send_error(self, error: ApiError) -> None:
        self._buffer.append(b"data: " + error.to_json() + b"\n\n")
        await self.flush()

    async def finish(self) -> None:
        self._buffer.append(b"data: [DONE]\n\n")
        await self.flush()
        await self.response.write_eof()


AddEvents = Callable[[EventStream], None]
AddOutputEvents = Callable[[EventStream, int, RequestOutput], None]


async def stream_events(
    request: web.Request,
    generation: Generation,
    add_output: AddOutputEvents,
    *,
    add_opening: AddEvents | None = None,
    add_closing: AddEvents | None = None,
    stream_class: type[EventStream] = EventStream,
) -> web.StreamResponse:
    """Answer with a generation as server-sent events.

    ``add_opening`` chunks, then ``add_output(events, prompt_index, output)`` per engine output,
    written whenever no more outputs wait (the first at once), then ``add_closing`` chunks and
    ``[DONE]``. Whenever no output comes for the serving context's ``sse_keep_alive_s`` (a long
    queue wait or prefill), a keep-alive comment goes out. An error before anything was sent
    keeps its HTTP status (the middleware answers it); a later one becomes an error event. A
    client that went away ends the stream quietly. ``stream_class`` writes the events (OpenAI's
    ``data:`` lines by default).
    """
    events = stream_class(request)
    ctx = request.app.get(CONTEXT_KEY)
    idle_s = ctx.sse_keep_alive_s if ctx is not None else None
    outputs = generation.outputs(idle_s, events.keep_alive)
    async with contextlib.aclosing(outputs):
        try:
            await _write_events(events, generation, outputs, add_output, add_opening, add_closing)
        except ApiError as error:
            if not events.is_open:
                raise
            await events.send_error(error)
        except ConnectionResetError:
            if not events.is_open:
                raise
            return events.response
        except Exception as error:  # a bug: tell the client, keep serving others
            if not events.is_open:
                raise
            await events.send_error(internal_error(error))
        await events.finish()
    return events.response


async def _write_events(
    events: EventStream,
    generation: Generation,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    add_output: AddOutputEvents,
    add_opening: AddEvents | None,
    add_closing: AddEvents | None,
) -> None:
    first = await anext(outputs, None)
    await events.open()
    if add_opening is not None:
        add_opening(events)
    if first is not None:
        add_output(events, *first)
    await events.flush()
    async for prompt_index, output in outputs:
        add_output(events, prompt_index, output)
        if not generation.has_pending():
            await events.flush()
    if add_closing is not None:
        add_closing(events)
