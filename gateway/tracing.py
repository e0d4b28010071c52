"""The gateway's span of each API request it serves (``--otlp-traces-endpoint``), the root of
the request's trace, or a child of the caller's when it sent a W3C ``traceparent`` (an HTTP
header, or a NATS message header on the NATS API): ``POST /v1/chat/completions`` (SERVER, with
the route, the method and the response's status) or ``nats responses``. While the request is
served, its context is ``tracing.context.incoming_trace``: the engine client's span of the
request goes under it. Paths outside ``/v1/`` (health, metrics, load) are not traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from shoal.tracing.context import incoming_trace, trace_headers

if TYPE_CHECKING:
    from shoal.tracing.tracer import ActorTracer, TraceSpan

TRACED_PREFIX = "/v1/"


@contextlib.contextmanager
def serving_span(
    tracer: ActorTracer,
    name: str,
    carried: Mapping[str, str] | None,
    attributes: Mapping[str, Any],
) -> Iterator[TraceSpan]:
    """A SERVER span under the caller's context ``carried`` (its headers), current as
    ``incoming_trace`` while inside; failed by an exception that leaves it."""
    span = tracer.start(name, trace_headers(carried), kind="server", attributes=attributes)
    token = incoming_trace.set(span.headers)
    try:
        yield span
    except BaseException as exc:
        span.fail(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        incoming_trace.reset(token)
        span.end()


def tracing_middleware(tracer: ActorTracer) -> Middleware:
    """Trace every ``/v1/`` request (the outermost middleware: it sees the status sent)."""

    @web.middleware
    async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith(TRACED_PREFIX):
            return await handler(request)
        route = request.match_info.route.resource
        path = route.canonical if route is not None else request.path
        attributes = {"http.request.method": request.method, "http.route": path}
        with serving_span(tracer, f"{request.method} {path}", request.headers, attributes) as span:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                _record_status(span, exc.status)
                raise
            _record_status(span, response.status)
            return response

    return traced


def _record_status(span: TraceSpan, status: int) -> None:
    span.set({"http.response.status_code": status})
    if status >= 500:
        span.fail(f"HTTP {status}")
