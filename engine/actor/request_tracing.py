"""The engine core's spans of the traced requests it runs (``--otlp-traces-endpoint``), kept
by its shell: a request is traced when its add carried a sampled W3C context in its message
headers (the engine client's ``llm_request`` span).

Per traced request, under that context:

- ``engine_core.request`` from the add's arrival to the request's end here (finished, aborted,
  failed, turned away), with this engine core's id and incarnation, the prompt's length, the
  tokens it brought (a resumed request), its finish reason and cached tokens;
- ``engine_core.queue`` under it, from the arrival to the step that first scheduled it, and
  ``engine_core.schedule`` under that first step: the scheduler's decision that admitted it;
- per step it joined, ``engine_core.step`` from that step's scheduling to its result landing
  (the step's id, this request's tokens in it, the batch's requests). The step span's context
  goes to the workers in ``ExecuteStep.trace_parents``: their spans of the step are its
  children.

Step spans are recorded once they end (``ActorTracer.record``: a span per request per token,
so the cheap way). Untraced requests cost a dictionary lookup per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.bus.messages.engine import AddRequest
from shoal.engine.core.request import ClientOutputs
from shoal.engine.core.scheduler_output import SchedulerOutput
from shoal.tracing.context import is_sampled, trace_headers

if TYPE_CHECKING:
    from shoal.tracing.tracer import ActorTracer, SpanRef, TraceSpan


@dataclass(slots=True)
class TracedRequest:
    span: TraceSpan  # engine_core.request
    arrival_ns: int
    queued: bool = True  # not scheduled yet


@dataclass(slots=True)
class TracedStep:
    """A step in flight: its span for each traced request in it, and when it began."""

    start_ns: int
    num_requests: int
    spans: list[tuple[SpanRef, int]]  # (the request's step span, its tokens in the step)


class RequestTracing:
    """The open spans of one engine core's traced requests and of their steps in flight."""

    def __init__(self, tracer: ActorTracer, engine_id: str, incarnation: Callable[[], str]) -> None:
        self.tracer = tracer
        self.engine_id = engine_id
        self._incarnation = incarnation
        self.requests: dict[str, TracedRequest] = {}
        self._steps: dict[int, TracedStep] = {}  # step id → its spans, until it lands

    def on_add(self, add: AddRequest, headers: Mapping[str, str] | None) -> None:
        """An add arrived: trace it if its context asks to be recorded."""
        carried = trace_headers(headers)
        if not is_sampled(carried):
            return
        now = time.time_ns()
        span = self.tracer.start(
            "engine_core.request",
            carried,
            kind="consumer",
            start_ns=now,
            attributes={
                "shoal.engine.id": self.engine_id,
                "shoal.incarnation": self._incarnation(),
                "shoal.request.id": add.request_id,
                "gen_ai.usage.prompt_tokens": len(add.prompt_token_ids),
                "shoal.request.num_resumed_tokens": len(add.output_token_ids),
            },
        )
        self.requests[add.request_id] = TracedRequest(span, now)

    def on_step_sent(
        self, step: SchedulerOutput, schedule_start_ns: int, schedule_end_ns: int
    ) -> dict[str, str]:
        """A step was scheduled: open its spans for the traced requests in it; their contexts
        (request id → traceparent) for the workers."""
        if not self.requests:
            return {}
        parents: dict[str, str] = {}
        spans: list[tuple[SpanRef, int]] = []
        tracer = self.tracer
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            traced = self.requests.get(request_id)
            if traced is None:
                continue
            ref = tracer.child(traced.span)
            if traced.queued:
                traced.queued = False
                tracer.record(
                    "engine_core.queue", traced.span, traced.arrival_ns, schedule_start_ns
                )
                tracer.record("engine_core.schedule", ref, schedule_start_ns, schedule_end_ns)
            spans.append((ref, num_tokens))
            parents[request_id] = ref.traceparent
        if spans:
            num_requests = len(step.num_scheduled_tokens)
            self._steps[step.step_id] = TracedStep(schedule_start_ns, num_requests, spans)
        return parents

    def on_step_landed(self, step_id: int) -> None:
        """A step's result was applied: its spans end."""
        traced = self._steps.pop(step_id, None)
        if traced is not None:
            self._record_step(step_id, traced, time.time_ns())

    def abandon_steps(self, reason: str) -> None:
        """The steps in flight will never land (a fault): their spans end failed."""
        now = time.time_ns()
        for step_id, traced in self._steps.items():
            self._record_step(step_id, traced, now, reason)
        self._steps.clear()

    def _record_step(
        self, step_id: int, traced: TracedStep, end_ns: int, error: str | None = None
    ) -> None:
        for ref, num_tokens in traced.spans:
            attributes = {
                "shoal.step.id": step_id,
                "shoal.step.num_tokens": num_tokens,
                "shoal.step.num_requests": traced.num_requests,
            }
            self.tracer.record_as(
                ref,
                "engine_core.step",
                traced.start_ns,
                end_ns,
                attributes=attributes,
                error=error,
            )

    def on_outputs(self, outputs: ClientOutputs) -> None:
        """End the spans of the traced requests that these outputs finish."""
        if not self.requests:
            return
        for client_outputs in outputs.values():
            for output in client_outputs:
                traced = self.requests.get(output.request_id)
                if traced is None:
                    continue
                if output.num_cached_tokens:  # (on its first output)
                    traced.span.set({"gen_ai.usage.num_cached_tokens": output.num_cached_tokens})
                if output.finish_reason is None:
                    continue
                del self.requests[output.request_id]
                traced.span.set({"gen_ai.response.finish_reasons": [output.finish_reason]})
                if output.finish_reason == "error":
                    traced.span.fail(output.error or "the request failed")
                traced.span.end()

    def end(self, request_id: str, reason: str) -> None:
        """The request ends here without an output (turned away: ``reason``)."""
        traced = self.requests.pop(request_id, None)
        if traced is not None:
            traced.span.fail(reason)
            traced.span.end()

    def close(self, reason: str) -> None:
        """The engine core stops: every open span ends."""
        self.abandon_steps(reason)
        for request_id in list(self.requests):
            self.end(request_id, reason)
