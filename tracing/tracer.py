"""One actor's tracer over the OpenTelemetry SDK, and its spans (this module imports
OpenTelemetry: only ``setup.actor_tracer`` imports it, once an endpoint is set).

The rest of shoal sees no OpenTelemetry type: a span's parent is another ``TraceSpan`` or a
carried W3C context (``context.trace_headers``), and a span gives its own context back as
headers for the next actor. Spans are batched (``BatchSpanProcessor``, tuned by
OpenTelemetry's ``OTEL_BSP_*`` environment) and exported from a thread of the SDK's;
sampling follows the parent's flag (a root is sampled as ``OTEL_TRACES_SAMPLER`` says:
always, by default). Each actor's spans carry its service name (``shoal-<kind>``) and id.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
SPAN_KINDS = {
    "internal": SpanKind.INTERNAL,
    "server": SpanKind.SERVER,
    "client": SpanKind.CLIENT,
    "producer": SpanKind.PRODUCER,
    "consumer": SpanKind.CONSUMER,
}
Attributes = Mapping[str, Any]


class TraceSpan:
    """One open span."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    @property
    def headers(self) -> dict[str, str]:
        """This span's context as W3C headers, to parent spans of other actors."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, set_span_in_context(self._span))
        return carrier

    @property
    def is_recording(self) -> bool:
        return self._span.is_recording()

    def set(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        self._span.add_event(name, attributes)

    def fail(self, message: str) -> None:
        """Mark the span's work as failed (status ERROR with ``message``)."""
        self._span.set_status(Status(StatusCode.ERROR, message))

    def end(self, end_ns: int | None = None) -> None:
        self._span.end(end_ns)


Parent = TraceSpan | Mapping[str, str] | None


class ActorTracer:
    """Starts one actor's spans and exports them (``shutdown`` flushes what is left)."""

    def __init__(self, provider: TracerProvider) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("shoal")

    def start(
        self,
        name: str,
        parent: Parent,
        *,
        kind: str = "internal",
        start_ns: int | None = None,
        attributes: Attributes | None = None,
    ) -> TraceSpan:
        """A span under ``parent`` (None: a new trace), begun at ``start_ns`` (default now)."""
        span = self._tracer.start_span(
            name, _context(parent), SPAN_KINDS[kind], attributes, start_time=start_ns
        )
        return TraceSpan(span)

    def record(
        self,
        name: str,
        parent: Parent,
        start_ns: int,
        end_ns: int,
        *,
        kind: str = "internal",
        attributes: Attributes | None = None,
    ) -> TraceSpan:
        """A span that already happened, from ``start_ns`` to ``end_ns`` (ended)."""
        span = self.start(name, parent, kind=kind, start_ns=start_ns, attributes=attributes)
        span.end(end_ns)
        return span

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Export every ended span now (blocking: call it off the event loop)."""
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export what is left and stop (blocking: call it off the event loop)."""
        self._provider.shutdown()


def _context(parent: Parent) -> Context:
    if parent is None:
        return Context()  # a new trace, whatever the thread's current context
    if isinstance(parent, TraceSpan):
        return set_span_in_context(parent._span, Context())
    return _PROPAGATOR.extract(dict(parent), Context())


def open_tracer(exporter: SpanExporter, kind: str, actor_id: str) -> ActorTracer:
    """A tracer for actor ``actor_id`` of ``kind`` exporting through ``exporter``."""
    resource = Resource.create(
        {
            "service.name": f"shoal-{kind}",
            "service.instance.id": actor_id,
            "host.name": socket.gethostname(),
            "process.pid": os.getpid(),
        }
    )
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return ActorTracer(provider)
