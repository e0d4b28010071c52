"""A step's result read against its requests: what happened, for the scheduler to apply.

``make_step_outcome`` advances the requests the result names and returns a ``StepOutcome``; it
touches no queue, KV block or counter (``Scheduler.update_from_output`` applies the outcome).

Sampled tokens are appended one at a time, each followed by ``check_stop``; tokens after a stop
are dropped (and their logprob rows trimmed). A request that stops is listed in ``stopped`` with
its finished status set. A partial prefill (no sampled token) produces no output unless it carries
prompt logprobs. Outputs are grouped by ``Request.client_id``.

A failed step (``StepResult.error``) lists the requests it names in ``failed``, with the error
set and their final output made; scheduled requests the result does not mention are listed in
``to_recompute`` with the tokens that never ran. Requests already finished, or aborted while
the step ran, are skipped, as are the ``skipped`` ids ``Scheduler.land_step`` names (stale outputs
of requests preempted while the step was in flight, and requests finished meanwhile).

Speculative decoding: a request that verified drafts first has its rejected ones rolled back
(``SpecDecoding.accept``); the tokens are then appended and stop-checked one by one as above (a
stop inside an accepted run drops the rest), and the drafts proposed for its next step are
taken from the result.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

from shoal.bus.messages.engine import EngineCoreOutput, Logprobs
from shoal.bus.messages.worker import StepError, StepResult
from shoal.engine.core.request import FINISH_REASONS, Request, RequestStatus
from shoal.engine.core.scheduler_output import SchedulerOutput
from shoal.engine.core.spec_decoding import SpecDecoding
from shoal.engine.core.stop_check import check_stop

RUNNING = RequestStatus.RUNNING


class StepOutcome:
    """What one step's result did to its requests, and what the scheduler must do about it."""

    __slots__ = (
        "failed",
        "num_generation_tokens",
        "num_prompt_tokens",
        "outputs",
        "stopped",
        "to_recompute",
    )

    def __init__(self) -> None:
        self.outputs: dict[str, list[EngineCoreOutput]] = {}  # client id → outputs to publish
        self.stopped: list[Request] = []  # finished by a stop check: free them
        self.failed: list[Request] = []  # named by a failed step: finish them with an error
        self.to_recompute: list[tuple[Request, int]] = []  # unreported, with their unrun tokens
        self.num_prompt_tokens = 0  # prompts of requests that got their first token
        self.num_generation_tokens = 0


def make_step_outcome(
    requests: Mapping[str, Request],
    scheduler_output: SchedulerOutput,
    result: StepResult,
    max_model_len: int,
    skipped: Set[str] = frozenset(),
    spec: SpecDecoding | None = None,
) -> StepOutcome:
    """Advance ``requests`` by ``result`` (the answer to ``scheduler_output``); ``spec``:
    speculative decoding is on."""
    if result.step_id != scheduler_output.step_id:
        raise ValueError(
            f"result is for step {result.step_id}, expected {scheduler_output.step_id}"
        )
    outcome = StepOutcome()
    if spec is not None:
        _read_drafts(requests, scheduler_output, result, skipped, spec)
    _read_sampled_tokens(outcome, requests, result, max_model_len, skipped)
    if result.error is not None:
        _read_failure(outcome, requests, result.error)
    num_scheduled = scheduler_output.num_scheduled_tokens
    if len(result.req_ids) < len(num_scheduled):
        _read_unreported(outcome, requests, num_scheduled, result.req_ids, skipped)
    return outcome


def _read_sampled_tokens(
    outcome: StepOutcome,
    requests: Mapping[str, Request],
    result: StepResult,
    max_model_len: int,
    skipped: Set[str],
) -> None:
    outputs, stopped = outcome.outputs, outcome.stopped
    all_logprobs = result.logprobs
    all_prompt_logprobs = result.prompt_logprobs
    all_pooled = result.pooled
    num_prompt_tokens = num_generated = 0
    for index, (request_id, sampled) in enumerate(
        zip(result.req_ids, result.sampled_token_ids, strict=True)
    ):
        request = requests.get(request_id)
        if request is None or request.status is not RUNNING or request_id in skipped:
            continue  # aborted or finished while the step ran, or preempted since it was sent
        logprobs = all_logprobs[index] if all_logprobs else None
        prompt_logprobs = all_prompt_logprobs[index] if all_prompt_logprobs else None
        if not sampled:
            if prompt_logprobs is not None:
                _add(outputs, request, _progress_output(request, prompt_logprobs))
            continue
        if len(sampled) == 1:
            request.append_output_token_id(sampled[0])
            is_stopped = check_stop(request, max_model_len)
            new_token_ids = sampled
        else:
            new_token_ids, is_stopped = _append_until_stop(request, sampled, max_model_len)
            if logprobs is not None and len(new_token_ids) < len(sampled):
                logprobs = _trim_logprobs(logprobs, len(new_token_ids))
        num_new = len(new_token_ids)
        num_generated += num_new
        first_output = request.num_output_tokens - request.num_resumed_tokens == num_new
        if first_output:
            num_prompt_tokens += request.num_prompt_tokens
        finish_reason = None
        if is_stopped:
            stopped.append(request)
            finish_reason = FINISH_REASONS[request.status]
        output = EngineCoreOutput(
            request_id,
            new_token_ids,
            finish_reason,
            request.stop_reason,
            logprobs,
            prompt_logprobs,
            request.num_cached_tokens,
            scheduled_time=request.first_scheduled_time if first_output else None,
            pooled=all_pooled[index] if all_pooled else None,
            num_prior_tokens=request.num_output_tokens - num_new,
        )
        client_outputs = outputs.get(request.client_id)
        if client_outputs is None:
            outputs[request.client_id] = [output]
        else:
            client_outputs.append(output)
    outcome.num_prompt_tokens = num_prompt_tokens
    outcome.num_generation_tokens = num_generated


def _read_drafts(
    requests: Mapping[str, Request],
    scheduler_output: SchedulerOutput,
    result: StepResult,
    skipped: Set[str],
    spec: SpecDecoding,
) -> None:
    """Roll back each live request's rejected drafts and take its new ones."""
    num_verified = scheduler_output.num_spec_tokens
    proposed = result.spec_token_ids
    for index, (request_id, sampled) in enumerate(
        zip(result.req_ids, result.sampled_token_ids, strict=True)
    ):
        request = requests.get(request_id)
        if request is None or request.status is not RUNNING or request_id in skipped:
            continue
        if sampled and request_id in num_verified:
            spec.accept(request, num_verified[request_id], len(sampled))
        spec.take_drafts(request, proposed[index] if proposed else [])
    spec.end_landing()


def _read_failure(outcome: StepOutcome, requests: Mapping[str, Request], error: StepError) -> None:
    """The unfinished requests a failed step names, each once, with the error text."""
    failed = outcome.failed
    failed_ids: set[str] = set()
    for request_id in error.req_ids:
        request = requests.get(request_id)
        if request is None or request.is_finished or request_id in failed_ids:
            continue
        failed_ids.add(request_id)
        failed.append(request)
        request.error = error.message
        final = request.make_final_output(RequestStatus.FINISHED_ERROR)
        _add(outcome.outputs, request, final)


def _read_unreported(
    outcome: StepOutcome,
    requests: Mapping[str, Request],
    num_scheduled_tokens: dict[str, int],
    reported_req_ids: list[str],
    skipped: Set[str],
) -> None:
    """Running requests scheduled but not in the result: their scheduled tokens never ran."""
    reported = set(reported_req_ids)
    failed = {request.request_id for request in outcome.failed}
    to_recompute = outcome.to_recompute
    for request_id, num_tokens in num_scheduled_tokens.items():
        if request_id in reported or request_id in failed or request_id in skipped:
            continue
        request = requests.get(request_id)
        if request is None or request.status is not RUNNING:
            continue
        to_recompute.append((request, num_tokens))


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


def _progress_output(request: Request, prompt_logprobs: Logprobs) -> EngineCoreOutput:
    return EngineCoreOutput(
        request.request_id, [], prompt_logprobs=prompt_logprobs, num_cached_tokens=0
    )


def _add(
    outputs: dict[str, list[EngineCoreOutput]], request: Request, output: EngineCoreOutput
) -> None:
    outputs.setdefault(request.client_id, []).append(output)
