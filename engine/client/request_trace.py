"""The engine client's span of one request, vLLM's ``llm_request`` (with its attribute names):
begun under the caller's trace context (``tracing.context.incoming_trace``: the gateway's span
of the HTTP or NATS request; a new trace without one) before the request is sent, so its context
rides with every add of every attempt; ended by the request's last output with the usage,
finish reasons and latencies (time to first token, end to end), or by the error that ended it.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from shoal.bus.messages.sampling import OutputKind, SamplingParams
from shoal.engine.client.outputs import RequestOutput
from shoal.tracing.context import incoming_trace

if TYPE_CHECKING:
    from shoal.tracing.tracer import ActorTracer, TraceSpan


class RequestTrace:
    """One request's ``llm_request`` span, fed the outputs its caller receives."""

    def __init__(
        self, tracer: ActorTracer, request_id: str, params: SamplingParams, model: str
    ) -> None:
        self._started = time.monotonic()
        self._first_token_s: float | None = None
        self._ended = False
        self._deltas = params.output_kind is OutputKind.DELTA  # outputs carry new tokens only
        self._num_tokens = 0  # generated so far, every completion together
        self.span: TraceSpan = tracer.start(
            "llm_request",
            incoming_trace.get(),
            attributes={
                "gen_ai.request.id": request_id,
                "gen_ai.response.model": model,
                "gen_ai.request.max_tokens": params.max_tokens or 0,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.request.n": params.n,
            },
        )

    @property
    def headers(self) -> dict[str, str]:
        """The span's context, carried by the request's adds."""
        return self.span.headers

    def on_output(self, output: RequestOutput) -> None:
        """Note the first token; end the span with the request's last output."""
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if self._first_token_s is None and num_tokens:
            self._first_token_s = time.monotonic() - self._started
        self._num_tokens = self._num_tokens + num_tokens if self._deltas else num_tokens
        if not output.finished or self._ended:
            return
        reasons = [c.finish_reason or "" for c in output.outputs]
        self.span.set(
            {
                "gen_ai.usage.prompt_tokens": len(output.prompt_token_ids),
                "gen_ai.usage.completion_tokens": self._num_tokens,
                "gen_ai.response.finish_reasons": reasons,
                "gen_ai.latency.e2e": time.monotonic() - self._started,
                "gen_ai.usage.num_cached_tokens": output.num_cached_tokens,
            }
        )
        if self._first_token_s is not None:
            self.span.set({"gen_ai.latency.time_to_first_token": self._first_token_s})
        if output.error is not None or "error" in reasons:
            self.span.fail(output.error or "a completion ended with an error")
        self._end()

    def fail(self, error: BaseException) -> None:
        """End the span for a request that ended without its last output: aborted (its
        caller went away) or failed with ``error``."""
        if self._ended:
            return
        if isinstance(error, GeneratorExit | asyncio.CancelledError):
            self.span.set({"gen_ai.response.finish_reasons": ["abort"]})
        else:
            self.span.fail(f"{type(error).__name__}: {error}")
        self._end()

    def _end(self) -> None:
        self._ended = True
        self.span.end()
