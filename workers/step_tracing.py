"""A worker's spans of the steps it ran for traced requests (``--otlp-traces-endpoint``): one
``worker.execute`` per traced request in the step, under the engine core's span of that step
for it (``ExecuteStep.trace_parents``), from the step's arrival here to its result, with the
step's id and the error it ended with (the worker is the span's service instance; the batch
is on the parent). Recorded, the cheap way: a span per request per token."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.bus.messages.worker import ExecuteStep, StepResult
from shoal.tracing.context import TRACEPARENT

if TYPE_CHECKING:
    from shoal.tracing.tracer import ActorTracer


def record_step(
    tracer: ActorTracer, step: ExecuteStep, result: StepResult, start_ns: int, end_ns: int
) -> None:
    """Record ``step``'s execution for each traced request in it."""
    attributes = {"shoal.step.id": step.step_id}
    error = result.error.message if result.error is not None else None
    for traceparent in step.trace_parents.values():
        tracer.record(
            "worker.execute",
            {TRACEPARENT: traceparent},
            start_ns,
            end_ns,
            kind="consumer",
            attributes=attributes,
            error=error,
        )
