"""Preemption under KV pressure: victims, recompute from 0, resume as new, priority policy."""

from __future__ import annotations

from shoal.engine.core.request import Request, RequestStatus
from shoal.engine.core.scheduler import Scheduler
from shoal.engine.core.scheduler_output import SchedulerOutput
from tests.unit.factories import FakeWorker, make_request, make_scheduler, run_to_completion


def step_until_preemption(
    scheduler: Scheduler, worker: FakeWorker, max_steps: int = 50
) -> SchedulerOutput:
    for _ in range(max_steps):
        output = scheduler.schedule()
        scheduler.update_from_output(output, worker.execute(output.to_message()))
        if output.preempted_req_ids:
            return output
    raise AssertionError("no preemption happened")


def long_request(request_id: str, first_token: int, **kwargs: object) -> Request:
    return make_request(
        request_id,
        list(range(first_token, first_token + 8)),
        max_tokens=12,
        ignore_eos=True,
        **kwargs,  # type: ignore[arg-type]
    )


def preempt_background_for_later_arrivals(scheduler: Scheduler) -> SchedulerOutput:
    """'background' (priority 5) runs first; 'urgent' (0) and 'normal' (1) arrive after it, so
    it precedes them in the running list; returns the step that preempts."""
    worker = FakeWorker(4)
    scheduler.add_request(long_request("background", 100, priority=5))
    first = scheduler.schedule()
    scheduler.update_from_output(first, worker.execute(first.to_message()))
    scheduler.add_request(long_request("urgent", 200, priority=0))
    scheduler.add_request(long_request("normal", 300, priority=1))
    return step_until_preemption(scheduler, worker)


def test_fcfs_preempts_the_last_admitted_and_requeues_it_first() -> None:
    scheduler = make_scheduler(num_blocks=8)  # 7 usable blocks of 4 tokens
    worker = FakeWorker(4)
    for index in range(3):
        scheduler.add_request(long_request(f"r{index}", 100 + 10 * index))
    output = step_until_preemption(scheduler, worker)
    assert output.preempted_req_ids == ["r2"]
    victim = scheduler.requests["r2"]
    assert victim.status is RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1
    assert scheduler.waiting.peek() is victim
    assert "r2" not in output.num_scheduled_tokens
    assert output.new_requests == []
    assert scheduler.make_stats().num_preemptions == 1


def test_preempted_request_resumes_with_its_outputs_and_same_tokens() -> None:
    scheduler = make_scheduler(num_blocks=8)
    worker = FakeWorker(4)
    for index in range(3):
        scheduler.add_request(long_request(f"r{index}", 100 + 10 * index))
    step_until_preemption(scheduler, worker)
    outputs_so_far = list(scheduler.requests["r2"].output_token_ids)
    assert outputs_so_far  # it had produced tokens before being preempted
    resumed = None
    for _ in range(50):
        output = scheduler.schedule()
        scheduler.update_from_output(output, worker.execute(output.to_message()))
        resumed = next((d for d in output.new_requests if d.req_id == "r2"), None)
        if resumed is not None:
            break
    assert resumed is not None and resumed.resumed
    assert resumed.output_token_ids[: len(outputs_so_far)] == outputs_so_far
    assert resumed.prompt_token_ids == list(range(120, 128))
    # Recomputed from token 0, minus what its own cached blocks still hold.
    assert resumed.num_computed_tokens % 4 == 0
    assert resumed.num_computed_tokens + resumed.num_scheduled_tokens <= (
        8 + len(resumed.output_token_ids)
    )
    outputs = run_to_completion(scheduler, worker)
    assert outputs["r2"][-1].finish_reason == "length"
    assert len(scheduler.requests) == 0
    assert scheduler.kv_cache_manager.num_free_blocks == 7


def test_outputs_with_preemption_equal_outputs_without() -> None:
    def run(num_blocks: int) -> dict[str, list[int]]:
        scheduler = make_scheduler(num_blocks=num_blocks)
        for index in range(4):
            scheduler.add_request(long_request(f"r{index}", 100 + 10 * index))
        outputs = run_to_completion(scheduler, FakeWorker(4))
        return {k: [t for o in v for t in o.new_token_ids] for k, v in outputs.items()}

    assert run(8) == run(64)


def test_priority_policy_admits_lowest_value_first() -> None:
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    scheduler.add_request(make_request("late-urgent", [1, 2], priority=-1, arrival_time=5.0))
    scheduler.add_request(make_request("early", [3, 4], priority=0, arrival_time=1.0))
    scheduler.add_request(make_request("earliest", [5, 6], priority=0, arrival_time=0.0))
    order = []
    worker = FakeWorker(4)
    for _ in range(60):
        output = scheduler.schedule()
        order += [d.req_id for d in output.new_requests]
        scheduler.update_from_output(output, worker.execute(output.to_message()))
        if not scheduler.has_requests():
            break
    assert order == ["late-urgent", "earliest", "early"]


def test_priority_policy_preempts_the_least_urgent_even_if_scheduled_earlier() -> None:
    scheduler = make_scheduler(scheduling_policy="priority", num_blocks=8)
    output = preempt_background_for_later_arrivals(scheduler)
    assert output.preempted_req_ids == ["background"]
    assert "background" not in output.num_scheduled_tokens  # its tokens were refunded
    assert output.total_num_scheduled_tokens == sum(output.num_scheduled_tokens.values())
    assert [r.request_id for r in scheduler.running] == ["urgent", "normal"]


def test_waiting_loop_is_skipped_in_a_step_that_preempted() -> None:
    scheduler = make_scheduler(scheduling_policy="priority", num_blocks=8)
    worker = FakeWorker(4)
    scheduler.add_request(long_request("a", 100, priority=0))
    scheduler.add_request(long_request("b", 200, priority=1))
    for _ in range(5):  # prefill, then decode positions 8..11: six blocks in use
        output = scheduler.schedule()
        scheduler.update_from_output(output, worker.execute(output.to_message()))
    assert scheduler.kv_cache_manager.num_free_blocks == 1
    # A tiny urgent request that would fit in the blocks the preemption frees.
    scheduler.add_request(make_request("tiny", [7], priority=-1, max_tokens=1))
    output = scheduler.schedule()
    if not output.preempted_req_ids:  # "a" still fitted in the last free block: one more step
        scheduler.update_from_output(output, worker.execute(output.to_message()))
        output = scheduler.schedule()
    assert output.preempted_req_ids == ["b"]
    assert output.new_requests == []
    scheduler.update_from_output(output, worker.execute(output.to_message()))
    following = scheduler.schedule()
    assert [d.req_id for d in following.new_requests] == ["tiny"]


def test_victim_unscheduled_mid_step_leaves_no_cached_hash_on_unwritten_kv() -> None:
    """A victim already scheduled this step never runs: the blocks its chunk filled must not stay
    findable in the prefix cache, or a later hit reads KV that was never written."""
    scheduler = make_scheduler(
        scheduling_policy="priority",
        block_size=2,
        num_blocks=10,
        max_num_batched_tokens=5,
        long_prefill_token_threshold=4,
    )
    worker = FakeWorker(2)
    scheduler.add_request(
        make_request("victim", list(range(100, 116)), priority=1, max_tokens=2, ignore_eos=True)
    )
    first = scheduler.schedule()  # alone: 5 prompt tokens
    scheduler.update_from_output(first, worker.execute(first.to_message()))
    scheduler.add_request(
        make_request("urgent", [50], priority=0, max_tokens=3, ignore_eos=True, arrival_time=1.0)
    )
    output = step_until_preemption(scheduler, worker)
    assert output.preempted_req_ids == ["victim"]  # after its last chunk was planned
    outputs = run_to_completion(scheduler, worker)  # the worker checks every KV slot it reads
    assert outputs["victim"][-1].finish_reason == "length"
    assert scheduler.kv_cache_manager.num_free_blocks == 9


def test_preempted_request_goes_ahead_of_requests_already_waiting() -> None:
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=3)
    worker = FakeWorker(4)
    for index in range(4):  # r3 waits: max_num_seqs keeps it out while three run
        scheduler.add_request(long_request(f"r{index}", 100 + 10 * index))
    output = step_until_preemption(scheduler, worker)
    assert output.preempted_req_ids == ["r2"]
    assert [r.request_id for r in scheduler.waiting] == ["r2", "r3"]
    outputs = run_to_completion(scheduler, worker)
    assert {r: outs[-1].finish_reason for r, outs in outputs.items()} == {
        f"r{i}": "length" for i in range(4)
    }


def test_requests_after_an_earlier_victim_still_run_in_the_preempting_step() -> None:
    """Preempting a request the loop already passed must neither skip the next request nor
    keep the victim's refunded tokens out of the budget."""
    scheduler = make_scheduler(scheduling_policy="priority", num_blocks=8, max_num_batched_tokens=3)
    output = preempt_background_for_later_arrivals(scheduler)
    assert output.preempted_req_ids == ["background"]
    assert set(output.num_scheduled_tokens) == {"urgent", "normal"}
    assert output.total_num_scheduled_tokens == 3


def test_a_victim_longer_than_the_watermark_allows_resumes_once_nothing_runs() -> None:
    """The watermark keeps blocks free for running requests to grow into. A victim preempted
    after outgrowing ``usable - watermark`` blocks could never be admitted under it again; with
    nothing running there is nothing to keep room for, so it must resume then."""
    scheduler = make_scheduler(num_blocks=9, watermark=0.5)  # 8 usable, 4 kept free
    worker = FakeWorker(4)
    for index in range(2):
        prompt = list(range(100 + 10 * index, 104 + 10 * index))
        scheduler.add_request(make_request(f"r{index}", prompt, max_tokens=20, ignore_eos=True))
    outputs = run_to_completion(scheduler, worker, max_steps=300)
    assert scheduler.num_preemptions >= 1
    assert {r: sum(len(o.new_token_ids) for o in outs) for r, outs in outputs.items()} == {
        "r0": 20,
        "r1": 20,
    }


def test_priority_ties_do_not_take_turns_preempting_each_other() -> None:
    """Two requests of equal priority and arrival that cannot both fit: the one behind in the
    running list is the victim, so the one ahead finishes. Picking the first of the tie made
    them preempt each other in turn, recomputing more than they advanced, forever (found by
    the property test)."""
    scheduler = make_scheduler(
        max_num_batched_tokens=40,
        max_num_seqs=2,
        max_model_len=40,
        long_prefill_token_threshold=3,
        scheduling_policy="priority",
        scheduler_reserve_full_isl=False,
        block_size=1,
        enable_prefix_caching=False,
        num_blocks=33,
    )
    for index, prompt in enumerate(([3, 4, 5, 6, 7, 8, *[3] * 10], [3, 4, 5, *[9] * 8, *[3] * 6])):
        request = make_request(f"r{index}", prompt, max_tokens=7, priority=1, arrival_time=7.0)
        scheduler.add_request(request)
    outputs = run_to_completion(scheduler, FakeWorker(1), max_steps=200)
    assert scheduler.num_preemptions >= 1
    assert {r: sum(len(o.new_token_ids) for o in outs) for r, outs in outputs.items()} == {
        "r0": 7,
        "r1": 7,
    }
