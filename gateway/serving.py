"""What the endpoint handlers share (``ServingContext``: the engine and served name, the
deployment's serving options; the HTTP and NATS APIs hold the same one), typed body decoding, the
model check, per-choice accumulation and usage, and an HTTP answer streamed as server-sent events
(``stream_events``) with keep-alive comments while no output comes."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from shoal.bus.messages.lora import LoRARequest
from shoal.engine.client.interface import EngineClientInterface
from shoal.engine.client.outputs import CompletionOutput
from shoal.gateway.embedding_options import EmbeddingOptions
from shoal.gateway.errors import from_decode_error, unavailable
from shoal.gateway.events import AddEvents, AddOutputEvents, SseEventStream, write_stream
from shoal.gateway.generation import Generation
from shoal.gateway.lora_adapters import LoRAAdapters
from shoal.gateway.metrics import Metrics
from shoal.gateway.request_types import decode_json_body
from shoal.gateway.response_store import ResponseStore
from shoal.gateway.response_types import Usage, make_usage
from shoal.gateway.tools import ToolCallingOptions

T = TypeVar("T")

DEFAULT_SSE_KEEP_ALIVE_S = 15.0


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
    draining: bool = False  # stopping: /health says 503 so load balancers send no more

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for a model
        this server does not have."""
        return self.loras.resolve(model, self.served_model_name)

    def model_name(self, lora: LoRARequest | None) -> str:
        """The name a response gives as its ``model``: the adapter's, or the served one."""
        return self.served_model_name if lora is None else lora.lora_name

    def check_ready(self) -> None:
        """503 for a request the engine client would refuse; while requests resume, one that
        finds every engine core down for now waits for one instead (a rolling restart)."""
        if not self.engine.accepts_requests():
            raise unavailable("no engine core is ready")


def serving_context(
    engine: EngineClientInterface,
    *,
    served_model_name: str | None = None,
    metrics: Metrics | None = None,
    **options: Any,
) -> ServingContext:
    """A serving context for ``engine``: served as ``served_model_name`` (default: the engine's
    model), its own metrics unless given, and ``options`` (``ServingContext``'s other fields)."""
    name = served_model_name or engine.model_name
    if metrics is None:
        metrics = Metrics(name, max_model_len=engine.max_model_len)
    return ServingContext(engine, name, metrics, **options)


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


async def stream_events(
    request: web.Request,
    generation: Generation,
    add_output: AddOutputEvents,
    *,
    add_opening: AddEvents | None = None,
    add_closing: AddEvents | None = None,
    stream_class: type[SseEventStream] = SseEventStream,
) -> web.StreamResponse:
    """Answer an HTTP request with a generation as server-sent events (``write_stream`` says
    how), a keep-alive comment going out whenever no output comes for the serving context's
    ``sse_keep_alive_s`` (a long queue wait or prefill). An error before anything was sent
    keeps its HTTP status (the middleware answers it). ``stream_class`` writes the events
    (OpenAI's ``data:`` lines by default)."""
    ctx = request.app.get(CONTEXT_KEY)
    events = stream_class(request, ctx.sse_keep_alive_s if ctx is not None else None)
    await write_stream(
        events, generation, add_output, add_opening=add_opening, add_closing=add_closing
    )
    return events.response
