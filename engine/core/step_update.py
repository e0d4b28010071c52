"""Applying a step's result to the scheduler's requests (``Scheduler.update_from_output``).

A failed step (``StepResult.error``) finishes the requests it names with FINISHED_ERROR and
forgets their cached hashes; scheduled requests the result does not mention are preempted and
recomputed from token 0.

Sampled tokens are appended one at a time, each followed by ``check_stop``; tokens after a stop
are dropped (and their logprob rows trimmed). A request that stops is freed at once and its id
sent to the worker with the next step. A partial prefill (no sampled token) produces no output
unless it carries prompt logprobs. Outputs are grouped by ``Request.client_id``.

Seam: speculative decoding would first roll back rejected draft tokens here
(``num_computed_tokens -= num_drafts - (len(sampled) - 1)``); async scheduling would resolve
``num_output_placeholders`` and skip stale outputs of preempted requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.bus.messages.engine import Logprobs, RequestOutput
from shoal.bus.messages.worker import StepError, StepResult
from shoal.engine.core.request import FINISH_REASONS, Request, RequestStatus
from shoal.engine.core.stop_check import check_stop

if TYPE_CHECKING:
    from shoal.engine.core.scheduler import Scheduler
    from shoal.engine.core.scheduler_output import SchedulerOutput

RUNNING = RequestStatus.RUNNING


class StepUpdater:
    """Turns a ``StepResult`` into request progress and per-client outputs; counts tokens."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.num_prompt_tokens = 0  # prompts of requests that got their first token
        self.num_generation_tokens = 0

    def apply(
        self, scheduler_output: SchedulerOutput, result: StepResult
    ) -> dict[str, list[RequestOutput]]:
        if result.step_id != scheduler_output.step_id:
            raise ValueError(
                f"result is for step {result.step_id}, expected {scheduler_output.step_id}"
            )
        scheduler = self.scheduler
        requests = scheduler.requests
        max_model_len = scheduler.max_model_len
        all_logprobs = result.logprobs
        all_prompt_logprobs = result.prompt_logprobs
        outputs: dict[str, list[RequestOutput]] = {}
        num_stopped = num_generated = 0
        for index, (request_id, sampled) in enumerate(
            zip(result.req_ids, result.sampled_token_ids, strict=True)
        ):
            request = requests.get(request_id)
            if request is None or request.status is not RUNNING:
                continue  # aborted or finished while the step ran
            logprobs = all_logprobs[index] if all_logprobs else None
            prompt_logprobs = all_prompt_logprobs[index] if all_prompt_logprobs else None
            if not sampled:
                if prompt_logprobs is not None:
                    _add(outputs, request, _progress_output(request, prompt_logprobs))
                continue
            if len(sampled) == 1:
                request.append_output_token_id(sampled[0])
                stopped = check_stop(request, max_model_len)
                new_token_ids = sampled
            else:
                new_token_ids, stopped = _append_until_stop(request, sampled, max_model_len)
                if logprobs is not None and len(new_token_ids) < len(sampled):
                    logprobs = _trim_logprobs(logprobs, len(new_token_ids))
            num_new = len(new_token_ids)
            num_generated += num_new
            first_output = len(request.output_token_ids) == num_new
            if first_output:
                self.num_prompt_tokens += request.num_prompt_tokens
            finish_reason = None
            if stopped:
                num_stopped += 1
                finish_reason = FINISH_REASONS[request.status]
                scheduler.release_finished(request, was_on_worker=True)
            output = RequestOutput(
                request_id,
                new_token_ids,
                finish_reason,
                request.stop_reason,
                logprobs,
                prompt_logprobs,
                request.num_cached_tokens,
                scheduled_time=request.first_scheduled_time if first_output else None,
            )
            client_outputs = outputs.get(request.client_id)
            if client_outputs is None:
                outputs[request.client_id] = [output]
            else:
                client_outputs.append(output)
        self.num_generation_tokens += num_generated
        if num_stopped:
            scheduler.running = [r for r in scheduler.running if r.status is RUNNING]
        if result.error is not None:
            self._fail_requests(result.error, outputs)
        num_scheduled = scheduler_output.num_scheduled_tokens
        if len(result.req_ids) < len(num_scheduled):
            reported = set(result.req_ids)
            self._recompute_unreported(
                {r: n for r, n in num_scheduled.items() if r not in reported}
            )
        return outputs

    def _fail_requests(self, error: StepError, outputs: dict[str, list[RequestOutput]]) -> None:
        """Finish the requests a failed step names with FINISHED_ERROR and the error text."""
        scheduler = self.scheduler
        for request_id in error.req_ids:
            request = scheduler.requests.get(request_id)
            if request is None:
                continue
            request.error = error.message
            # The step's KV for these requests may be garbage: forget their cached hashes.
            scheduler.finish_request(request, RequestStatus.FINISHED_ERROR, drop_cached=True)
            _add(outputs, request, request.make_final_output())

    def _recompute_unreported(self, num_unreported_tokens: dict[str, int]) -> None:
        """Scheduled requests a result did not mention: preempt them, to recompute from 0.

        ``num_unreported_tokens`` maps each to the tokens it was scheduled: they never ran.
        """
        scheduler = self.scheduler
        for request_id, num_tokens in num_unreported_tokens.items():
            request = scheduler.requests.get(request_id)
            if request is None or request.status is not RUNNING:
                continue
            request.num_computed_tokens -= num_tokens  # so their blocks are not cached
            scheduler.running.remove(request)
            scheduler.preempt(request)
            scheduler.preempted_req_ids.append(request_id)


def _append_until_stop(
    request: Request, sampled: list[int], max_model_len: int
) -> tuple[list[int], bool]:
    for position, token_id in enumerate(sampled):
        request.append_output_token_id(token_id)
        if check_stop(request, max_model_len):
            return sampled[: position + 1], True
    return sampled, False


def _trim_logprobs(logprobs: Logprobs, num_rows: int) -> Logprobs:
    return Logprobs(
        logprobs.token_ids[:num_rows], logprobs.logprobs[:num_rows], logprobs.ranks[:num_rows]
    )


def _progress_output(request: Request, prompt_logprobs: Logprobs) -> RequestOutput:
    return RequestOutput(
        request.request_id, [], prompt_logprobs=prompt_logprobs, num_cached_tokens=0
    )


def _add(outputs: dict[str, list[RequestOutput]], request: Request, output: RequestOutput) -> None:
    outputs.setdefault(request.client_id, []).append(output)
