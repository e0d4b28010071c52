"""The aiohttp application: routes, Bearer auth on ``/v1/*`` and ``/fault_tolerance/*``, the
request spans when tracing (``gateway.tracing``), and the error middleware that turns every
failure into an OpenAI-shaped error body (and never takes the server down).

``create_app`` takes any ``EngineClientInterface``; ``gateway.server`` runs the app on a socket.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from shoal.engine.client.interface import EngineClientInterface, FaultToleranceApi
from shoal.engine.client.tokenizer import tokenizer_config
from shoal.gateway.anthropic_messages import create_message
from shoal.gateway.anthropic_messages import error_response as anthropic_error_response
from shoal.gateway.chat import create_chat_completion
from shoal.gateway.chat_prompt import chat_options, render_chat
from shoal.gateway.completions import create_completion
from shoal.gateway.embedding_options import EmbeddingOptions
from shoal.gateway.embeddings import create_embedding
from shoal.gateway.errors import ApiError, bad_request, internal_error
from shoal.gateway.fault_tolerance import FaultToleranceEndpoints
from shoal.gateway.lora_adapters import LoRAAdapters
from shoal.gateway.metrics import CONTENT_TYPE, Metrics
from shoal.gateway.request_types import (
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from shoal.gateway.response_store import ResponseStore
from shoal.gateway.response_types import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from shoal.gateway.responses import cancel_response, create_response, get_response
from shoal.gateway.serving import (
    CONTEXT_KEY,
    DEFAULT_SSE_KEEP_ALIVE_S,
    ServingContext,
    decode_body,
    serving_context,
)
from shoal.gateway.tools import ToolCallingOptions
from shoal.gateway.tracing import tracing_middleware

if TYPE_CHECKING:
    from shoal.tracing.tracer import ActorTracer

MAX_BODY_BYTES = 32 * 1024 * 1024
PROTECTED_PREFIXES = ("/v1/", "/fault_tolerance/")  # behind the API key, when there is one
MESSAGES_PATH = "/v1/messages"  # Anthropic's: its errors in Anthropic's shape
_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def create_app(
    engine_client: EngineClientInterface,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    metrics: Metrics | None = None,
    sse_keep_alive_s: float | None = DEFAULT_SSE_KEEP_ALIVE_S,
    fault_tolerance: FaultToleranceApi | None = None,
    tool_calling: ToolCallingOptions | None = None,
    trust_request_chat_template: bool = False,
    loras: LoRAAdapters | None = None,
    reasoning_parser: str | None = None,
    structured_in_reasoning: bool = False,
    embeddings: EmbeddingOptions | None = None,
    responses: ResponseStore | None = None,
    tracer: ActorTracer | None = None,
) -> web.Application:
    """The OpenAI-compatible app for one engine client (real or fake); a stream that waits
    ``sse_keep_alive_s`` for output gets a keep-alive comment (None: never). The
    ``/fault_tolerance/*`` endpoints use ``fault_tolerance`` (default: the client's own
    ``fault_tolerance`` attribute, if it has one); ``tool_calling``: the server's
    ``--enable-auto-tool-choice`` / ``--tool-call-parser`` (default: neither);
    ``trust_request_chat_template``: its ``--trust-request-chat-template``; ``loras``: the
    LoRA adapters served (with ``--enable-lora``: the run-time load and unload endpoints);
    ``reasoning_parser``: its ``--reasoning-parser`` (``structured_in_reasoning``: a grammar
    constrains the thinking too, vLLM's ``enable_in_reasoning``); ``embeddings``: with
    ``--runner pooling``, how ``/v1/embeddings`` answers; ``responses``: where stored responses
    are kept (default: this process); ``tracer``: with ``--otlp-traces-endpoint``, the
    gateway's (a span per ``/v1/`` request: ``gateway.tracing``)."""
    if fault_tolerance is None:
        fault_tolerance = getattr(engine_client, "fault_tolerance", None)
    ctx = serving_context(
        engine_client,
        served_model_name=served_model_name,
        metrics=metrics,
        sse_keep_alive_s=sse_keep_alive_s,
        tool_calling=tool_calling or ToolCallingOptions(),
        trust_request_chat_template=trust_request_chat_template,
        loras=loras or LoRAAdapters(),
        reasoning_parser=reasoning_parser,
        structured_in_reasoning=structured_in_reasoning,
        embeddings=embeddings,
        responses=responses or ResponseStore(),
    )
    middlewares: list[Middleware] = [] if tracer is None else [tracing_middleware(tracer)]
    middlewares.append(error_middleware)
    if api_key:
        middlewares.append(bearer_auth(api_key))
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[CONTEXT_KEY] = ctx
    app.router.add_post("/v1/completions", _with_context(create_completion))
    app.router.add_post("/v1/chat/completions", _with_context(create_chat_completion))
    app.router.add_get("/v1/models", _with_context(list_models))
    app.router.add_post(MESSAGES_PATH, _with_context(create_message))
    app.router.add_post("/v1/embeddings", _with_context(create_embedding))
    app.router.add_post("/v1/responses", _with_context(create_response))
    app.router.add_get("/v1/responses/{response_id}", _with_context(get_response))
    app.router.add_post("/v1/responses/{response_id}/cancel", _with_context(cancel_response))
    if loras is not None and loras.enabled:
        app.router.add_post("/v1/load_lora_adapter", _with_context(load_lora_adapter))
        app.router.add_post("/v1/unload_lora_adapter", _with_context(unload_lora_adapter))
    app.router.add_get("/health", _with_context(health))
    app.router.add_route("*", "/ping", _with_context(health))
    app.router.add_get("/load", _with_context(load))
    app.router.add_get("/metrics", _with_context(render_metrics))
    app.router.add_post("/tokenize", _with_context(tokenize))
    app.router.add_post("/detokenize", _with_context(detokenize))
    app.router.add_get("/tokenizer_info", _with_context(tokenizer_info))
    app.router.add_get("/version", version)
    FaultToleranceEndpoints(fault_tolerance, ctx.metrics).install(app)
    return app


ContextHandler = Callable[[ServingContext, web.Request], Awaitable[web.StreamResponse]]


def _with_context(handler: ContextHandler) -> Handler:
    """An aiohttp handler that calls ``handler`` with the app's serving context."""

    async def bound(request: web.Request) -> web.StreamResponse:
        return await handler(request.app[CONTEXT_KEY], request)

    return bound


def json_response(body: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body), status=status, content_type="application/json"
    )


def error_response(error: ApiError) -> web.Response:
    return web.Response(body=error.to_json(), status=error.status, content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        return error_response(error)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        code = _ERROR_CODES.get(error.status)
        return error_response(ApiError(error.status, error.reason, code=code))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as error:
        return error_response(internal_error(error))


def bearer_auth(api_key: str) -> Middleware:
    """Middleware: ``/v1/*`` and ``/fault_tolerance/*`` need ``Authorization: Bearer <api_key>``
    (or Anthropic's ``x-api-key: <api_key>``)."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(PROTECTED_PREFIXES):
            given = request.headers.get("Authorization", "").encode()
            anthropic = b"Bearer " + request.headers.get("x-api-key", "").encode()
            if not (
                hmac.compare_digest(given, expected) or hmac.compare_digest(anthropic, expected)
            ):
                error = ApiError(401, "Invalid or missing API key.", code="invalid_api_key")
                if request.path == MESSAGES_PATH:
                    return anthropic_error_response(error)
                raise error
        return await handler(request)

    return check


async def list_models(ctx: ServingContext, request: web.Request) -> web.Response:
    name = ctx.served_model_name
    card = ModelCard(
        id=name,
        created=int(time.time()),
        max_model_len=ctx.engine.max_model_len,
        root=ctx.engine.model_name,
    )
    adapters = ctx.loras.cards(ctx.engine.max_model_len, name)
    return json_response(ModelList([card, *adapters]))


async def load_lora_adapter(ctx: ServingContext, request: web.Request) -> web.Response:
    """vLLM's ``POST /v1/load_lora_adapter``: serve the adapter in ``lora_path`` as
    ``lora_name`` from now on."""
    body = await decode_body(request, LoadLoRAAdapterRequest)
    await ctx.loras.add(body.lora_name, body.lora_path)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(ctx: ServingContext, request: web.Request) -> web.Response:
    """vLLM's ``POST /v1/unload_lora_adapter``: stop serving ``lora_name``."""
    body = await decode_body(request, UnloadLoRAAdapterRequest)
    ctx.loras.remove(body.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def health(ctx: ServingContext, request: web.Request) -> web.Response:
    if ctx.draining:
        return error_response(ApiError(503, "this gateway is shutting down", code="draining"))
    if ctx.engine.is_ready():
        return web.Response(status=200)
    return error_response(ApiError(503, "no engine core is ready", code="engine_unavailable"))


async def load(ctx: ServingContext, request: web.Request) -> web.Response:
    """vLLM's ``/load``: the engine requests this gateway is serving."""
    return json_response({"server_load": ctx.metrics.num_in_flight})


async def render_metrics(ctx: ServingContext, request: web.Request) -> web.Response:
    return web.Response(body=ctx.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def tokenize(ctx: ServingContext, request: web.Request) -> web.Response:
    body = await decode_body(request, TokenizeRequest)
    ctx.check_model(body.model)
    tokenizer = ctx.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        trusted = ctx.trust_request_chat_template
        options = chat_options(body, trust_request_chat_template=trusted)
        ids = render_chat(ctx.engine, body.messages, options, add_special_tokens=False).token_ids
    else:
        ids = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    strs = list(tokenizer.convert_ids_to_tokens(ids)) if body.return_token_strs else None
    return json_response(TokenizeResponse(len(ids), ctx.engine.max_model_len, ids, strs))


async def detokenize(ctx: ServingContext, request: web.Request) -> web.Response:
    body = await decode_body(request, DetokenizeRequest)
    ctx.check_model(body.model)
    tokenizer = ctx.engine.tokenizer
    if body.tokens and max(body.tokens) >= len(tokenizer):
        raise bad_request(f"token id {max(body.tokens)} is out of range", param="tokens")
    return json_response(DetokenizeResponse(tokenizer.decode(body.tokens)))


async def tokenizer_info(ctx: ServingContext, request: web.Request) -> web.Response:
    """vLLM's ``/tokenizer_info``: the tokenizer's configuration (``tokenizer_config``)."""
    return json_response(tokenizer_config(ctx.engine.tokenizer))


async def version(request: web.Request) -> web.Response:
    try:
        number = importlib.metadata.version("shoal")
    except importlib.metadata.PackageNotFoundError:
        number = "unknown"
    return json_response({"version": number})
