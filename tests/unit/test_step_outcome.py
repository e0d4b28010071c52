"""Step outcome: what a result did to its requests (pure), then the scheduler applying it."""

from __future__ import annotations

from shoal.bus.messages.worker import StepError, StepResult
from shoal.engine.core.request import RequestStatus
from shoal.engine.core.scheduler import Scheduler
from shoal.engine.core.scheduler_output import SchedulerOutput
from shoal.engine.core.step_outcome import StepOutcome, make_step_outcome
from tests.unit.factories import EOS, make_request, make_requests, make_scheduler


def scheduled(num_requests: int, prompt_len: int = 8) -> tuple[Scheduler, SchedulerOutput]:
    """A scheduler that has just planned one step for ``num_requests`` fresh requests."""
    scheduler = make_scheduler()
    for request in make_requests(num_requests, prompt_len, max_tokens=4):
        scheduler.add_request(request)
    return scheduler, scheduler.schedule()


def outcome_of(scheduler: Scheduler, output: SchedulerOutput, result: StepResult) -> StepOutcome:
    return make_step_outcome(scheduler.requests, output, result, scheduler.max_model_len)


def test_a_request_that_samples_a_stop_token_is_listed_as_stopped_and_left_in_place() -> None:
    scheduler, output = scheduled(2)
    outcome = outcome_of(
        scheduler, output, StepResult(output.step_id, ["req0", "req1"], [[EOS], [7]])
    )
    req0, req1 = scheduler.requests["req0"], scheduler.requests["req1"]
    assert outcome.stopped == [req0]
    assert req0.status is RequestStatus.FINISHED_STOPPED
    assert [(o.request_id, o.finish_reason) for o in outcome.outputs["client"]] == [
        ("req0", "stop"),
        ("req1", None),
    ]
    assert (outcome.failed, outcome.to_recompute) == ([], [])
    # Pure over the scheduler: nothing freed, dequeued or counted yet.
    assert scheduler.running == [req0, req1]
    assert scheduler.kv_cache_manager.get_block_ids("req0") == [1, 2]
    assert scheduler.finished_req_ids == []
    assert scheduler.make_stats().num_generation_tokens == 0


def test_the_requests_a_failed_step_names_are_listed_as_failed_with_their_error() -> None:
    scheduler, output = scheduled(3)
    scheduler.add_request(make_request("waiting", [1, 2]))  # queued, not in this step
    error = StepError("CUDA exploded", ["req0", "req2", "req0", "waiting", "unknown"])
    outcome = outcome_of(
        scheduler, output, StepResult(output.step_id, ["req1"], [[7]], error=error)
    )
    requests = scheduler.requests
    assert outcome.failed == [requests["req0"], requests["req2"], requests["waiting"]]
    assert all(r.error == "CUDA exploded" for r in outcome.failed)
    finals = {o.request_id: o for o in outcome.outputs["client"]}
    assert [(o.finish_reason, o.error) for o in finals.values() if o.request_id != "req1"] == [
        ("error", "CUDA exploded")
    ] * 3
    assert requests["req0"].status is RequestStatus.RUNNING  # finishing is the scheduler's
    assert outcome.to_recompute == []  # the failed ones are not recomputed as well


def test_a_request_stopped_in_a_failed_step_is_not_failed_again() -> None:
    scheduler, output = scheduled(1)
    result = StepResult(output.step_id, ["req0"], [[EOS]], error=StepError("late", ["req0"]))
    outcome = outcome_of(scheduler, output, result)
    assert (len(outcome.stopped), outcome.failed) == (1, [])


def test_a_scheduled_request_the_result_does_not_mention_is_listed_to_recompute() -> None:
    scheduler, output = scheduled(3, prompt_len=6)
    outcome = outcome_of(scheduler, output, StepResult(output.step_id, ["req1"], [[7]]))
    requests = scheduler.requests
    assert outcome.to_recompute == [(requests["req0"], 6), (requests["req2"], 6)]
    assert requests["req0"].status is RequestStatus.RUNNING  # preempting is the scheduler's


def test_token_counts_cover_first_outputs_and_every_kept_token() -> None:
    scheduler, output = scheduled(2, prompt_len=5)
    result = StepResult(output.step_id, ["req0", "req1"], [[7, EOS, 9], [8]])
    outcome = outcome_of(scheduler, output, result)
    assert (outcome.num_prompt_tokens, outcome.num_generation_tokens) == (10, 3)
    assert [o.new_token_ids for o in outcome.outputs["client"]] == [[7, EOS], [8]]


def test_the_scheduler_applies_the_outcome_and_owns_the_counters() -> None:
    scheduler, output = scheduled(3, prompt_len=8)
    error = StepError("bad rank", ["req1"])
    result = StepResult(output.step_id, ["req0", "req1"], [[EOS], []], error=error)
    outputs = scheduler.update_from_output(output, result)
    assert [(o.request_id, o.finish_reason) for o in outputs["client"]] == [
        ("req0", "stop"),
        ("req1", "error"),
    ]
    assert set(scheduler.requests) == {"req2"}  # req0 stopped, req1 failed: both forgotten
    assert scheduler.finished_req_ids == ["req0", "req1"]
    assert scheduler.running == []
    req2 = scheduler.requests["req2"]  # unreported: preempted, to recompute from 0
    assert (req2.status, req2.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert scheduler.preempted_req_ids == ["req2"] and list(scheduler.waiting) == [req2]
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == 64
    # Only req0's KV is trusted: req1's step failed and req2's tokens never ran.
    pool = kv.block_pool
    assert sorted(pool.get_cached_block(h) for h in pool.cached_hashes()) == [1, 2]  # type: ignore[type-var]
    stats = scheduler.make_stats()
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (8, 1)
    assert stats.num_preemptions == 1


def test_each_output_says_how_many_tokens_came_before_its_own() -> None:
    """``num_prior_tokens``: what a client checks its stream against (a gap: lost outputs)."""
    scheduler, output = scheduled(2)
    first = outcome_of(
        scheduler, output, StepResult(output.step_id, ["req0", "req1"], [[7, 8], [9]])
    )
    assert [o.num_prior_tokens for o in first.outputs["client"]] == [0, 0]
    second = outcome_of(
        scheduler, output, StepResult(output.step_id, ["req0", "req1"], [[10], [11, 12]])
    )
    assert [o.num_prior_tokens for o in second.outputs["client"]] == [2, 1]
