"""A worker's spans of the steps it ran for traced requests (``--otlp-traces-endpoint``): one
``worker.execute`` per traced request in the step, under the engine core's span of that step
for it (``ExecuteStep.trace_parents``), from the step's arrival here to its result, with this
worker's id and rank, the step's id and batch, and the error the step ended with."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.bus.messages.worker import ExecuteStep, StepResult
from shoal.tracing.context import TRACEPARENT

if TYPE_CHECKING:
    from shoal.tracing.tracer import ActorTracer


def record_step(
    tracer: ActorTracer,
    step: ExecuteStep,
    result: StepResult,
    start_ns: int,
    end_ns: int,
    worker: dict[str, str | int],
) -> None:
    """Record ``step``'s execution for each traced request in it (``worker``: attributes
    naming this worker)."""
    batch = step.batch_order()
    attributes = {
        **worker,
        "shoal.step.id": step.step_id,
        "shoal.step.num_requests": len(batch.req_ids),
        "shoal.step.num_batched_tokens": sum(batch.num_scheduled_tokens),
    }
    for traceparent in step.trace_parents.values():
        span = tracer.start(
            "worker.execute",
            {TRACEPARENT: traceparent},
            kind="consumer",
            start_ns=start_ns,
            attributes=attributes,
        )
        if result.error is not None:
            span.fail(result.error.message)
        span.end(end_ns)
