"""One actor's tracer over the OpenTelemetry SDK, and its spans (this module imports
OpenTelemetry: only ``setup.actor_tracer`` imports it, once an endpoint is set).

The rest of shoal sees no OpenTelemetry type: a span's parent is another span (``TraceSpan``,
``SpanRef``) or a carried W3C context (``context.trace_headers``), and a span gives its own
context back for the next actor. Two ways to make a span:

- ``start`` opens one through the SDK (a request's spans: sampled as the parent says, a root as
  ``OTEL_TRACES_SAMPLER`` says, always by default), ended by its holder;
- ``record`` writes one that already happened (a step's spans, many per token); or its
  identity is made first (``child``, a ``SpanRef``: sent on as a parent) and ``record_as``
  writes it at its end. Both skip the SDK's span machinery (a tenth of the cost) and write only
  under a sampled parent.

Spans are batched (``BatchSpanProcessor``, tuned by OpenTelemetry's ``OTEL_BSP_*``
environment) and exported from a thread of the SDK's. Each actor's spans carry its service name
(``shoal-<kind>``), its id, host and pid.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shoal.tracing.context import TRACEPARENT

_PROPAGATOR = TraceContextTextMapPropagator()
SCOPE = "shoal"
SPAN_KINDS = {
    "internal": SpanKind.INTERNAL,
    "server": SpanKind.SERVER,
    "client": SpanKind.CLIENT,
    "producer": SpanKind.PRODUCER,
    "consumer": SpanKind.CONSUMER,
}
Attributes = Mapping[str, Any]


class TraceSpan:
    """One open span (``ActorTracer.start``)."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    @property
    def context(self) -> SpanContext:
        return self._span.get_span_context()

    @property
    def headers(self) -> dict[str, str]:
        """This span's context as W3C headers, to parent spans of other actors."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, set_span_in_context(self._span))
        return carrier

    def set(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def fail(self, message: str) -> None:
        """Mark the span's work as failed (status ERROR with ``message``)."""
        self._span.set_status(Status(StatusCode.ERROR, message))

    def end(self, end_ns: int | None = None) -> None:
        self._span.end(end_ns)


class SpanRef:
    """The identity of a span to ``record`` later (under ``parent``), known before it ends."""

    __slots__ = ("context", "parent")

    def __init__(self, context: SpanContext, parent: SpanContext) -> None:
        self.context = context
        self.parent = parent

    @property
    def traceparent(self) -> str:
        """Its context as a W3C ``traceparent``."""
        c = self.context
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


Parent = TraceSpan | SpanRef | Mapping[str, str] | None


class ActorTracer:
    """Starts and records one actor's spans and exports them (``shutdown`` flushes the rest)."""

    def __init__(self, exporter: SpanExporter, resource: Resource) -> None:
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._processor = BatchSpanProcessor(exporter)
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer(SCOPE)
        self._resource = resource
        self._scope = InstrumentationScope(SCOPE)
        self._ids = RandomIdGenerator()

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
        context = set_span_in_context(NonRecordingSpan(_span_context(parent)), Context())
        span = self._tracer.start_span(
            name, context, SPAN_KINDS[kind], attributes, start_time=start_ns
        )
        return TraceSpan(span)

    def child(self, parent: Parent) -> SpanRef:
        """A new span's identity under ``parent`` (a span of this actor's or a carried one)."""
        above = _span_context(parent)
        context = SpanContext(
            above.trace_id,
            self._ids.generate_span_id(),
            is_remote=False,
            trace_flags=above.trace_flags,
            trace_state=above.trace_state,
        )
        return SpanRef(context, above)

    def record(
        self,
        name: str,
        parent: Parent,
        start_ns: int,
        end_ns: int,
        *,
        kind: str = "internal",
        attributes: Attributes | None = None,
        error: str | None = None,
    ) -> None:
        """Write a new span under ``parent`` that ran from ``start_ns`` to ``end_ns`` (failed
        with ``error``)."""
        ref = self.child(parent)
        self.record_as(ref, name, start_ns, end_ns, kind=kind, attributes=attributes, error=error)

    def record_as(
        self,
        ref: SpanRef,
        name: str,
        start_ns: int,
        end_ns: int,
        *,
        kind: str = "internal",
        attributes: Attributes | None = None,
        error: str | None = None,
    ) -> None:
        """Write the span ``ref`` (made by ``child`` before it ended) as ``record`` does
        (the batch processor drops it if its parent, whose flags it took, was not sampled)."""
        status = Status(StatusCode.ERROR, error) if error is not None else Status(StatusCode.UNSET)
        self._processor.on_end(
            ReadableSpan(
                name=name,
                context=ref.context,
                parent=ref.parent,
                resource=self._resource,
                attributes=attributes,
                kind=SPAN_KINDS[kind],
                status=status,
                start_time=start_ns,
                end_time=end_ns,
                instrumentation_scope=self._scope,
            )
        )

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Export every ended span now (blocking: call it off the event loop)."""
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export what is left and stop (blocking: call it off the event loop)."""
        self._provider.shutdown()


def _span_context(parent: Parent) -> SpanContext:
    if parent is None:
        return INVALID_SPAN_CONTEXT
    if isinstance(parent, TraceSpan | SpanRef):
        return parent.context
    if set(parent) == {TRACEPARENT}:
        return _remote(parent[TRACEPARENT])
    return get_current_span(_PROPAGATOR.extract(dict(parent), Context())).get_span_context()


def _remote(traceparent: str) -> SpanContext:
    """A carried ``traceparent`` (no ``tracestate``), parsed (an invalid one: no parent)."""
    try:
        _, trace_id, span_id, flags = traceparent.split("-")[:4]
        trace_flags = TraceFlags(int(flags, 16))
        context = SpanContext(int(trace_id, 16), int(span_id, 16), True, trace_flags)
    except ValueError:
        return INVALID_SPAN_CONTEXT
    return context if context.is_valid else INVALID_SPAN_CONTEXT


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
    return ActorTracer(exporter, resource)
