"""Async scheduling in the pure scheduler: two steps in flight, output placeholders, stops and
preemptions while a step is in flight, and prefix caching of landed KV only.

The fake worker appends its own sampled tokens (like ``workers/request_store.py``), so a step sent
before the previous result is applied runs; ``Pipeline`` keeps ``depth`` steps in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from shoal.engine.core.request import Request, RequestStatus, group_final_outputs
from shoal.engine.core.scheduler import Scheduler
from tests.unit.factories import (
    EOS,
    FakeWorker,
    Pipeline,
    default_token_for,
    make_request,
    make_scheduler,
)

TokenFor = Callable[[str, int], int]


def eos_at(positions: dict[str, int]) -> TokenFor:
    """The default model, but EOS at the given absolute position of the given requests."""

    def token_for(request_id: str, position: int) -> int:
        if positions.get(request_id) == position:
            return EOS
        return default_token_for(request_id, position)

    return token_for


def run(
    depth: int,
    requests: Callable[[], list[Request]],
    token_for: TokenFor = default_token_for,
    **settings: Any,
) -> Pipeline:
    """Run fresh copies of ``requests`` to the end with ``depth`` steps in flight."""
    scheduler = make_scheduler(async_scheduling=depth > 1, **settings)
    for request in requests():
        scheduler.add_request(request)
    pipeline = Pipeline(scheduler, FakeWorker(scheduler.block_size, token_for), depth)
    pipeline.run()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.num_blocks - 1
    assert not scheduler.pending_frees
    return pipeline


def summary(pipeline: Pipeline) -> dict[str, tuple[list[int], str | None, int | str | None]]:
    """Each request's tokens, finish reason and stop reason; exactly one final output each."""
    result = {}
    for request_id, outputs in pipeline.outputs.items():
        reasons = [o.finish_reason for o in outputs]
        assert reasons[-1] is not None and all(r is None for r in reasons[:-1]), reasons
        tokens = [t for o in outputs for t in o.new_token_ids]
        result[request_id] = (tokens, reasons[-1], outputs[-1].stop_reason)
    return result


def mixed() -> list[Request]:
    return [
        make_request(f"m{i}", list(range(3 + i, 3 + i + 3 + 5 * i)), max_tokens=1 + (i * 5) % 13)
        for i in range(7)
    ]


def long_prompts() -> list[Request]:
    return [make_request(f"c{i}", [5 + i] * (15 + 9 * i), max_tokens=6) for i in range(4)]


def shared_prefix() -> list[Request]:
    prefix = list(range(20, 33))
    return [make_request(f"p{i}", [*prefix, 40 + i], max_tokens=5 + i) for i in range(4)]


def siblings() -> list[Request]:
    """An ``n > 1`` request as the client fans it out: same prompt, ids i_<k>_<parent>."""
    return [make_request(f"i_{k}_r", list(range(50, 61)), max_tokens=7) for k in range(3)]


def crowded() -> list[Request]:
    return [make_request(f"q{i}", [7 + i] * 10, max_tokens=12) for i in range(5)]


def stopping() -> list[Request]:
    return [
        make_request("s0", [3, 4, 5], max_tokens=20, stop_token_ids=[default_token_for("s0", 6)]),
        make_request("s1", [6, 7, 8, 9], max_tokens=20),  # EOS at position 8 (eos_at below)
        make_request("s2", [6, 7, 8, 9], max_tokens=20, ignore_eos=True),
    ]


SCENARIOS: dict[str, tuple[Callable[[], list[Request]], TokenFor, dict[str, Any]]] = {
    "mixed lengths": (mixed, default_token_for, {}),
    "chunked prefill": (long_prompts, default_token_for, {"max_num_batched_tokens": 8}),
    "prefix hits": (shared_prefix, default_token_for, {"max_num_batched_tokens": 16}),
    "n > 1 siblings": (siblings, default_token_for, {}),
    "preemption": (crowded, default_token_for, {"num_blocks": 12}),
    "stop tokens and eos": (stopping, eos_at({"s1": 8, "s2": 8}), {}),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("depth", [2, 3])
def test_greedy_outputs_are_the_same_with_two_steps_in_flight(name: str, depth: int) -> None:
    """(Three steps in flight, which the engine core does not allow, let a preempted request
    resume before its stale output lands.)"""
    requests, token_for, settings = SCENARIOS[name]
    lock_step = run(1, requests, token_for, **settings)
    pipelined = run(depth, requests, token_for, **settings)
    assert summary(pipelined) == summary(lock_step)
    stats = pipelined.scheduler.make_stats()
    if name == "prefix hits" and depth == 2:
        assert stats.prefix_cache_hits > 0
    if name == "n > 1 siblings":  # admitted in one step: they share blocks only in lock step
        assert lock_step.scheduler.make_stats().prefix_cache_hits > 0
    if name == "preemption":
        assert stats.num_preemptions > 0


def test_a_request_is_scheduled_again_before_its_result_lands() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("r", list(range(10, 20)), max_tokens=4))
    first = scheduler.schedule()
    request = scheduler.requests["r"]
    assert request.num_output_placeholders == 1 and request.num_in_flight_steps == 1
    second = scheduler.schedule()  # the prefill's token is not back yet
    assert second.num_scheduled_tokens == {"r": 1}
    assert second.cached_requests[0].num_computed_tokens == 10
    assert request.num_output_placeholders == 2 and request.num_in_flight_steps == 2
    worker = FakeWorker(scheduler.block_size)
    scheduler.update_from_output(first, worker.execute(first.to_message()))
    assert request.num_output_placeholders == 1 and request.num_in_flight_tokens == 1
    assert request.num_output_tokens == 1


def test_without_async_scheduling_nothing_is_scheduled_before_the_result() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", list(range(10, 20)), max_tokens=4))
    scheduler.schedule()
    assert scheduler.schedule().num_scheduled_tokens == {}
    assert scheduler.requests["r"].num_output_placeholders == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_max_tokens_is_exact_and_each_request_runs_prompt_plus_max_tokens_minus_one(
    depth: int,
) -> None:
    def requests() -> list[Request]:
        return [
            make_request(f"r{i}", [10 + i] * (3 * i + 1), max_tokens=1 + 2 * i) for i in range(6)
        ]

    pipeline = run(depth, requests, max_num_batched_tokens=12, block_size=2)
    for request in requests():
        tokens, reason, _ = summary(pipeline)[request.request_id]
        assert len(tokens) == request.max_tokens and reason == "length"
        expected = request.num_prompt_tokens + request.max_tokens - 1
        assert pipeline.num_scheduled[request.request_id] == expected


@pytest.mark.parametrize("depth", [1, 2])
def test_max_model_len_is_never_passed(depth: int) -> None:
    def requests() -> list[Request]:
        return [make_request("r", list(range(10, 30)), max_tokens=100)]

    pipeline = run(depth, requests, max_model_len=32)
    tokens, reason, _ = summary(pipeline)["r"]
    assert (len(tokens), reason) == (12, "length")
    assert pipeline.num_scheduled["r"] == 31  # the KV of position 31 is never computed


@pytest.mark.parametrize("depth", [1, 2])
def test_outputs_end_at_the_stop_token_and_eos_never_a_token_late(depth: int) -> None:
    stop_token = default_token_for("s0", 6)
    pipeline = run(depth, stopping, eos_at({"s1": 8, "s2": 8}))
    result = summary(pipeline)
    assert result["s0"] == ([default_token_for("s0", 3 + k) for k in range(4)], "stop", stop_token)
    assert result["s1"][0][-1] == EOS and len(result["s1"][0]) == 5
    assert result["s1"][1:] == ("stop", None)
    assert len(result["s2"][0]) == 20  # ignore_eos
    # With a step in flight when the stop token came back, that step's token is dropped.
    assert pipeline.num_scheduled["s0"] == 3 + 4 - 1 + (depth - 1)
    assert pipeline.num_scheduled["s1"] == 4 + 5 - 1 + (depth - 1)


def start_two_steps(token_for: TokenFor = default_token_for, **settings: Any) -> Pipeline:
    scheduler = make_scheduler(async_scheduling=True, **settings)
    scheduler.add_request(make_request("r", list(range(10, 18)), max_tokens=10))
    pipeline = Pipeline(scheduler, FakeWorker(scheduler.block_size, token_for))
    pipeline.schedule()
    pipeline.schedule()
    return pipeline


def blocks_in_flight(pipeline: Pipeline) -> list[int]:
    return [b for _, written in pipeline.outstanding for ids in written.values() for b in ids]


def assert_not_free(scheduler: Scheduler, block_ids: list[int]) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    assert block_ids and all(pool.ref_cnt(b) > 0 for b in block_ids)
    assert not set(block_ids) & set(pool.free_block_ids())


def test_a_stop_with_a_step_in_flight_adds_no_token_and_frees_blocks_after_it_lands() -> None:
    pipeline = start_two_steps(eos_at({"r": 8}))  # the prefill samples EOS
    scheduler = pipeline.scheduler
    request = scheduler.requests["r"]
    pipeline.land()
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert "r" not in scheduler.requests
    assert_not_free(scheduler, blocks_in_flight(pipeline))  # the decode step may still write
    assert scheduler.pending_frees
    assert pipeline.land() == {}  # its token comes back, and is not an output
    assert [o.new_token_ids for o in pipeline.outputs["r"]] == [[EOS]]
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.num_blocks - 1
    assert not scheduler.pending_frees


def test_an_abort_with_a_step_in_flight_frees_blocks_after_it_lands() -> None:
    pipeline = start_two_steps()
    scheduler = pipeline.scheduler
    pipeline.land()
    finished = scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    pipeline.record(group_final_outputs(finished))
    assert_not_free(scheduler, blocks_in_flight(pipeline))
    pipeline.land()
    assert [o.new_token_ids for o in pipeline.outputs["r"]] == [[default_token_for("r", 8)], []]
    assert pipeline.outputs["r"][-1].finish_reason == "abort"
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.num_blocks - 1
    assert scheduler.finished_req_ids == ["r"]  # the worker drops it with the next step


def test_a_preemption_with_a_step_in_flight_makes_its_output_stale() -> None:
    scheduler = make_scheduler(async_scheduling=True, num_blocks=7, block_size=4)
    scheduler.add_request(make_request("a", list(range(10, 22)), max_tokens=9))
    scheduler.add_request(make_request("b", list(range(30, 41)), max_tokens=9, arrival_time=1))
    pipeline = Pipeline(scheduler, FakeWorker(scheduler.block_size))
    victim = scheduler.requests["b"]
    pipeline.schedule()  # both prompts fill the pool
    second = pipeline.schedule()  # a needs a block: b, whose prefill is in flight, is preempted
    assert second is not None and second.preempted_req_ids == ["b"]
    assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert victim.num_stale_steps == 1 and victim.num_output_placeholders == 0
    assert_not_free(scheduler, pipeline.outstanding[0][1]["b"])  # its prefill may still write
    assert victim in scheduler.pending_frees
    pipeline.land()  # the prefill's token for b comes back: delivered by the worker, not counted
    assert victim.num_output_tokens == 0 and "b" not in pipeline.outputs
    assert victim.num_stale_steps == 0 and victim not in scheduler.pending_frees
    pipeline.run()
    expected = run(1, lambda: [make_request("b", list(range(30, 41)), max_tokens=9)])
    assert summary(pipeline)["b"] == summary(expected)["b"]


def test_blocks_are_cached_only_once_the_step_that_fills_them_lands() -> None:
    prompt = list(range(10, 19))  # two full blocks of 4, then one token
    scheduler = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("first", prompt, max_tokens=3))
    pipeline = Pipeline(scheduler, FakeWorker(scheduler.block_size))
    pipeline.schedule()
    assert scheduler.kv_cache_manager.block_pool.num_cached_hashes == 0
    scheduler.add_request(make_request("early", prompt, max_tokens=3))
    pipeline.schedule()
    assert scheduler.requests["early"].num_cached_tokens == 0  # the prefill is still in flight
    pipeline.land()
    assert scheduler.kv_cache_manager.block_pool.num_cached_hashes == 2
    scheduler.add_request(make_request("late", prompt, max_tokens=3))
    pipeline.schedule()
    assert scheduler.requests["late"].num_cached_tokens == 8
    pipeline.run()


def test_without_async_scheduling_a_prompt_is_cached_when_scheduled() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("first", list(range(10, 19)), max_tokens=3))
    scheduler.schedule()
    assert scheduler.kv_cache_manager.block_pool.num_cached_hashes == 2


def test_a_stale_output_is_ignored_even_after_the_request_resumed() -> None:
    """A request preempted and resumed before its stale step lands (possible with more than two
    steps in flight) still ignores that step's token."""
    scheduler = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("r", list(range(10, 20)), max_tokens=3))
    pipeline = Pipeline(scheduler, FakeWorker(scheduler.block_size), depth=3)
    pipeline.schedule()
    request = scheduler.requests["r"]
    scheduler.running.remove(request)  # as a failed step's unreported requests are
    scheduler.preempt(request)
    scheduler.preempted_req_ids.append("r")
    resumed = pipeline.schedule()
    assert resumed is not None and resumed.new_requests[0].resumed
    assert request.status is RequestStatus.RUNNING and request.num_stale_steps == 1
    pipeline.land()  # the stale prefill's token
    assert request.num_output_tokens == 0 and "r" not in pipeline.outputs
    pipeline.run()
    assert (
        summary(pipeline)["r"]
        == summary(run(1, lambda: [make_request("r", list(range(10, 20)), max_tokens=3)]))["r"]
    )
