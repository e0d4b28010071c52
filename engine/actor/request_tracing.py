"""The engine core's spans of the traced requests it runs (``--otlp-traces-endpoint``), kept
by its shell: a request is traced when its add carried a sampled W3C context in its message
headers (the engine client's ``llm_request`` span).

Per traced request, under that context:

- ``engine_core.request`` from the add's arrival to the request's end here (finished, aborted,
  failed, turned away), with this engine core's id and incarnation, the prompt's length, the
  tokens it brought (a resumed request), its finish reason and cached tokens;
- ``engine_core.queue`` under it, from the arrival to the step that first scheduled it;
- per step it joined, ``engine_core.step`` from that step's scheduling to its result landing
  (the step's id, this request's tokens in it, the batch's requests and tokens), with
  ``engine_core.schedule`` under it (the scheduler's decision). The step span's context goes
  to the workers in ``ExecuteStep.trace_parents``: their spans of the step are its children.

Untraced requests cost a dictionary lookup per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.bus.messages.engine import AddRequest
from shoal.engine.core.request import ClientOutputs
from shoal.engine.core.scheduler_output import SchedulerOutput
from shoal.tracing.context import TRACEPARENT, is_sampled, trace_headers

if TYPE_CHECKING:
    from shoal.tracing.tracer import ActorTracer, TraceSpan


@dataclass(slots=True)
class TracedRequest:
    span: TraceSpan  # engine_core.request
    arrival_ns: int
    queued: bool = True  # not scheduled yet


class RequestTracing:
    """The open spans of one engine core's traced requests and of their steps in flight."""

    def __init__(self, tracer: ActorTracer, engine_id: str, incarnation: Callable[[], str]) -> None:
        self.tracer = tracer
        self.engine_id = engine_id
        self._incarnation = incarnation
        self.requests: dict[str, TracedRequest] = {}
        self._steps: dict[int, list[TraceSpan]] = {}  # step id → its open step spans

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
        spans: list[TraceSpan] = []
        batch = {
            "shoal.step.id": step.step_id,
            "shoal.step.num_requests": len(step.num_scheduled_tokens),
            "shoal.step.num_batched_tokens": step.total_num_scheduled_tokens,
        }
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            traced = self.requests.get(request_id)
            if traced is None:
                continue
            if traced.queued:
                traced.queued = False
                self.tracer.record(
                    "engine_core.queue", traced.span, traced.arrival_ns, schedule_start_ns
                )
            span = self.tracer.start(
                "engine_core.step",
                traced.span,
                start_ns=schedule_start_ns,
                attributes={**batch, "shoal.step.num_tokens": num_tokens},
            )
            self.tracer.record("engine_core.schedule", span, schedule_start_ns, schedule_end_ns)
            spans.append(span)
            parents[request_id] = span.headers[TRACEPARENT]
        if spans:
            self._steps[step.step_id] = spans
        return parents

    def on_step_landed(self, step_id: int) -> None:
        """A step's result was applied: its spans end."""
        now = time.time_ns()
        for span in self._steps.pop(step_id, ()):
            span.end(now)

    def abandon_steps(self, reason: str) -> None:
        """The steps in flight will never land (a fault): their spans end failed."""
        now = time.time_ns()
        for spans in self._steps.values():
            for span in spans:
                span.fail(reason)
                span.end(now)
        self._steps.clear()

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
