"""The pure engine core with two steps in flight (async scheduling): step N+1 is scheduled while
N is outstanding, results are applied strictly in step order, aborts and failures while a step is
in flight end requests cleanly, and ``fail_all`` abandons every outstanding step."""

from __future__ import annotations

import pytest

from shoal.bus.messages.engine import AbortRequest, AddRequest, EngineCoreOutput
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import StepError, StepResult
from shoal.config.deployment import CacheConfig, SchedulerConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.core.request import ClientOutputs
from shoal.engine.core.scheduler_output import SchedulerOutput
from tests.unit.factories import FakeWorker


def make_core(async_scheduling: bool = True) -> EngineCore:
    return EngineCore(
        SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=8, async_scheduling=async_scheduling
        ),
        CacheConfig(block_size=4),
        num_blocks=64,
        max_model_len=256,
    )


def add(request_id: str, max_tokens: int = 6) -> AddRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = 10 + 20 * sum(map(ord, request_id)) % 200
    return AddRequest(request_id, list(range(start, start + 6)), params, "c", 0.0)


def by_request(outputs: ClientOutputs) -> dict[str, list[EngineCoreOutput]]:
    result: dict[str, list[EngineCoreOutput]] = {}
    for client_outputs in outputs.values():
        for output in client_outputs:
            result.setdefault(output.request_id, []).append(output)
    return result


def schedule(core: EngineCore) -> SchedulerOutput:
    core.apply_inputs()
    scheduler_output = core.schedule()
    assert scheduler_output is not None and not scheduler_output.is_empty
    return scheduler_output


def assert_all_blocks_free(core: EngineCore) -> None:
    scheduler = core.scheduler
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.num_blocks - 1
    assert not scheduler.pending_frees


def test_two_steps_may_be_outstanding_with_async_scheduling_one_without() -> None:
    core = make_core()
    core.admit(add("a"))
    first, second = schedule(core), schedule(core)
    assert list(core.outstanding) == [first, second] and not core.can_schedule
    with pytest.raises(RuntimeError, match="2 steps already in flight"):
        core.schedule()
    sync = make_core(async_scheduling=False)
    sync.admit(add("a"))
    schedule(sync)
    with pytest.raises(RuntimeError, match="1 steps already in flight"):
        sync.schedule()


def test_results_are_applied_strictly_in_step_order() -> None:
    core, worker = make_core(), FakeWorker(block_size=4)
    core.admit(add("a"))
    first, second = schedule(core), schedule(core)
    first_result = worker.execute(first.to_message())
    second_result = worker.execute(second.to_message())
    with pytest.raises(ValueError, match="out of order"):
        core.apply_result(second, second_result)
    with pytest.raises(ValueError, match="result is for step"):
        core.apply_result(first, second_result)
    assert by_request(core.apply_result(first, first_result))["a"][0].new_token_ids
    assert by_request(core.apply_result(second, second_result))["a"][0].new_token_ids
    assert not core.outstanding


def test_a_request_runs_with_two_steps_in_flight_to_exactly_max_tokens() -> None:
    core, worker = make_core(), FakeWorker(block_size=4)
    core.admit(add("a", max_tokens=5))
    tokens: list[int] = []
    steps = [schedule(core)]
    while steps:
        if core.can_schedule and core.scheduler.has_requests():
            next_step = core.schedule()
            if next_step is not None and not next_step.is_empty:
                steps.append(next_step)
                continue
        oldest = steps.pop(0)
        outputs = core.apply_result(oldest, worker.execute(oldest.to_message()))
        tokens += [t for o in by_request(outputs).get("a", []) for t in o.new_token_ids]
    assert len(tokens) == 5
    assert_all_blocks_free(core)


def test_an_abort_while_two_steps_are_in_flight_ends_the_request_once() -> None:
    core, worker = make_core(), FakeWorker(block_size=4)
    core.admit(add("a"))
    first, second = schedule(core), schedule(core)
    core.queue_abort(AbortRequest(["a"]))
    outputs = by_request(core.apply_result(first, worker.execute(first.to_message())))
    assert [(o.new_token_ids, o.finish_reason) for o in outputs["a"]] == [([], "abort")]
    assert core.scheduler.pending_frees  # the second step may still write its blocks
    assert core.apply_result(second, worker.execute(second.to_message())) == {}
    assert_all_blocks_free(core)


def test_a_failed_step_while_another_is_in_flight_errors_its_requests_once() -> None:
    core, worker = make_core(), FakeWorker(block_size=4)
    core.admit(add("a"))
    core.admit(add("b"))
    first = schedule(core)
    core.admit(add("c"))  # only in the second step
    second = schedule(core)
    assert set(second.num_scheduled_tokens) == {"a", "b", "c"}
    failure = StepResult(first.step_id, error=StepError("boom", ["a", "b"]))
    outputs = by_request(core.apply_result(first, failure))
    assert {r: [(o.finish_reason, o.error) for o in outs] for r, outs in outputs.items()} == {
        "a": [("error", "boom")],
        "b": [("error", "boom")],
    }
    worker.execute(first.to_message())  # (the fake cannot fail: run it to keep its state)
    outputs = by_request(core.apply_result(second, worker.execute(second.to_message())))
    assert set(outputs) == {"c"} and outputs["c"][0].finish_reason is None
    assert set(core.scheduler.requests) == {"c"}
    core.fail_all("stop")
    assert_all_blocks_free(core)


def test_fail_all_with_two_steps_in_flight_errors_every_request_and_drops_both() -> None:
    core, worker = make_core(), FakeWorker(block_size=4)
    core.admit(add("a"))
    core.admit(add("b"))
    first = schedule(core)
    core.apply_result(first, worker.execute(first.to_message()))
    assert core.scheduler.kv_cache_manager.block_pool.num_cached_hashes  # the prompts landed
    second = schedule(core)
    core.admit(add("c"))
    schedule(core)
    outputs = by_request(core.fail_all("worker lost"))
    assert {r: [(o.finish_reason, o.error) for o in outs] for r, outs in outputs.items()} == {
        r: [("error", "worker lost")] for r in "abc"
    }
    assert not core.outstanding and not core.has_work()
    assert_all_blocks_free(core)
    assert core.scheduler.kv_cache_manager.block_pool.num_cached_hashes == 0
    with pytest.raises(ValueError, match="out of order"):  # a late result is refused
        core.apply_result(second, worker.execute(second.to_message()))


def test_without_async_scheduling_an_abort_during_a_step_frees_its_blocks_at_once() -> None:
    """The step lands before the aborts that came during it, so nothing waits (as before)."""
    core, worker = make_core(async_scheduling=False), FakeWorker(block_size=4)
    core.admit(add("a"))
    first = schedule(core)
    core.queue_abort(AbortRequest(["a"]))
    core.apply_result(first, worker.execute(first.to_message()))
    assert_all_blocks_free(core)
    assert core.scheduler.kv_cache_manager.block_pool.num_cached_hashes  # its prompt stays cached


def test_a_reused_request_id_does_not_get_the_tokens_of_the_request_it_replaces() -> None:
    core, worker = make_core(), FakeWorker(block_size=4)
    core.admit(add("a"))
    first, second = schedule(core), schedule(core)
    core.queue_abort(AbortRequest(["a"]))
    core.apply_result(first, worker.execute(first.to_message()))
    core.admit(add("a", max_tokens=3))  # a client reuses the id while `second` is in flight
    third = schedule(core)
    assert third.new_requests[0].req_id == "a" and third.finished_req_ids == ["a"]
    assert core.apply_result(second, worker.execute(second.to_message())) == {}
    assert core.scheduler.requests["a"].num_output_tokens == 0
    outputs = by_request(core.apply_result(third, worker.execute(third.to_message())))
    assert len(outputs["a"][0].new_token_ids) == 1


def test_a_dummy_step_is_outstanding_in_order_and_lands_as_nothing() -> None:
    """A lock-step round where this rank has no tokens: the dummy step it sends is outstanding
    behind the real one in flight and lands without touching a request."""
    core = make_core()
    assert core.hold_dummy(None).step_id == 1 and len(core.outstanding) == 1  # idle engine
    dummy = core.outstanding[0]
    assert core.apply_result(dummy, StepResult(step_id=dummy.step_id)) == {}
    core.admit(add("a", max_tokens=1))
    real = schedule(core)
    empty = core.hold_dummy(core.schedule())  # a's one token is booked: nothing else to run
    assert list(core.outstanding) == [real, empty] and empty.step_id == real.step_id + 1
    with pytest.raises(ValueError, match="not a dummy"):
        core.hold_dummy(real)
    worker = FakeWorker(block_size=4)
    outputs = by_request(core.apply_result(real, worker.execute(real.to_message())))
    assert [o.new_token_ids for o in outputs["a"]] == [[worker.token_for("a", 6)]]
    assert core.apply_result(empty, StepResult(step_id=empty.step_id)) == {}
    assert not core.outstanding
