"""An actor's tracer (``tracing.tracer``) over an in-memory exporter: spans it starts follow
their parent's sampling, recorded spans (the per-token ones) are written under the right parent
and only under a sampled one, and a span's identity made first parents other actors' spans."""

from __future__ import annotations

import sys

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from shoal.config.observability import ObservabilityConfig
from shoal.tracing.exporter import TracingUnavailable
from shoal.tracing.setup import check_tracing
from shoal.tracing.tracer import ActorTracer, open_tracer

TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def tracer_and_spans() -> tuple[ActorTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return open_tracer(exporter, "engine", "engine-0"), exporter


def finished(tracer: ActorTracer, exporter: InMemorySpanExporter) -> dict[str, object]:
    tracer.force_flush()
    return {span.name: span for span in exporter.get_finished_spans()}


def test_spans_follow_a_carried_context_and_its_sampling() -> None:
    tracer, exporter = tracer_and_spans()
    sampled = {"traceparent": f"00-{TRACE_ID}-{SPAN_ID}-01", "tracestate": "k=v"}
    request = tracer.start("request", sampled, kind="consumer")
    step = tracer.child(request)
    assert step.traceparent == f"00-{TRACE_ID}-{step.context.span_id:016x}-01"
    tracer.record("schedule", step, 10, 20)
    tracer.record_as(step, "step", 10, 50, attributes={"shoal.step.id": 3}, error="abandoned")
    tracer.record("execute", {"traceparent": step.traceparent}, 30, 40)  # as a worker does
    request.end()
    spans = finished(tracer, exporter)
    assert set(spans) == {"request", "step", "schedule", "execute"}
    request_span, step_span = spans["request"], spans["step"]
    assert f"{request_span.parent.span_id:016x}" == SPAN_ID  # type: ignore[attr-defined]
    assert request_span.context.trace_state.get("k") == "v"  # type: ignore[attr-defined]
    assert step_span.parent.span_id == request_span.context.span_id  # type: ignore[attr-defined]
    for child in ("schedule", "execute"):
        assert spans[child].parent.span_id == step.context.span_id  # type: ignore[attr-defined]
    assert (step_span.start_time, step_span.end_time) == (10, 50)  # type: ignore[attr-defined]
    assert step_span.status.status_code is StatusCode.ERROR  # type: ignore[attr-defined]
    assert dict(step_span.attributes) == {"shoal.step.id": 3}  # type: ignore[attr-defined]
    assert spans["execute"].resource.attributes["service.name"] == "shoal-engine"  # type: ignore[attr-defined]


def test_nothing_is_recorded_under_an_unsampled_or_missing_parent() -> None:
    tracer, exporter = tracer_and_spans()
    unsampled = {"traceparent": f"00-{TRACE_ID}-{SPAN_ID}-00"}
    request = tracer.start("request", unsampled)
    tracer.record_as(tracer.child(request), "step", 1, 2)
    tracer.record("execute", {"traceparent": "00-garbage"}, 1, 2)
    tracer.record("orphan", None, 1, 2)
    request.end()
    assert finished(tracer, exporter) == {}
    root = tracer.start("root", None)  # a new trace, sampled by default
    root.end()
    assert set(finished(tracer, exporter)) == {"root"}


def test_tracing_asked_for_without_its_packages_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher's check names the extra to install; tracing off needs nothing."""
    module = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    check_tracing(ObservabilityConfig())
    with pytest.raises(TracingUnavailable, match=r"pip install 'shoal\[tracing\]'"):
        check_tracing(ObservabilityConfig(otlp_traces_endpoint="http://127.0.0.1:4317"))
