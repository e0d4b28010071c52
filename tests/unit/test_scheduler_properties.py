"""Property tests: random arrivals, prompts, aborts and tiny block pools that force preemption.

After every step the block accounting and queue invariants hold; every request finishes; each
request's tokens equal what the fake model produced for it (the fake worker also checks every KV
slot a request reads, so a wrong prefix-cache hit or a block shared by mistake fails the test).

Each runs on the C block arrays (where built) and on the Python ones. The same workloads run
with async scheduling and two steps in flight, checking as well that no
block an in-flight step may write is free or someone else's, that no cached block is still to be
written by a step in flight, and that the in-flight counts match the steps outstanding.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shoal.bus.messages.engine import EngineCoreOutput
from shoal.engine.core.block_pool_arrays import (
    BLOCK_ARRAYS_ENV,
    BlockArrays,
    make_block_arrays,
    native_block_arrays_available,
)
from shoal.engine.core.request import Request, RequestStatus, group_final_outputs
from shoal.engine.core.scheduler import Scheduler
from tests.unit.factories import EOS, FakeWorker, Pipeline, make_request, make_scheduler

MAX_MODEL_LEN = 40
MAX_PROMPT = 24
MAX_OUTPUT = 8
MAX_STEPS = 600


@pytest.fixture(autouse=True, params=["native", "python"])
def block_arrays(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every workload on the C block arrays (where built) and on the Python ones."""
    if request.param == "native" and not native_block_arrays_available():
        pytest.skip("the C block arrays are not built here")
    monkeypatch.setenv(BLOCK_ARRAYS_ENV, request.param)
    assert isinstance(make_block_arrays(2), BlockArrays) == (request.param == "python")
    return str(request.param)


def token_for(request_id: str, position: int) -> int:
    value = (sum(map(ord, request_id)) * 31 + position * 7) % 23
    return EOS if value == 0 else 10 + value


@dataclass
class Arrival:
    step: int
    prompt: list[int]
    max_tokens: int
    priority: int
    ignore_eos: bool
    cache_salt: str | None


@st.composite
def scenarios(
    draw: st.DrawFn, async_scheduling: bool = False
) -> tuple[Scheduler, list[Arrival], dict[int, list[int]]]:
    block_size = draw(st.sampled_from([1, 2, 4]))
    min_blocks = -(-(MAX_PROMPT + MAX_OUTPUT) // block_size) + 1
    chunked = draw(st.booleans())
    budget = draw(st.integers(4, 48)) if chunked else MAX_MODEL_LEN
    scheduler = make_scheduler(
        block_size=block_size,
        num_blocks=draw(st.integers(min_blocks, min_blocks * 2)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3])),
        scheduler_reserve_full_isl=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.2])),  # 0.2 still admits every prompt
        async_scheduling=async_scheduling,
    )
    prefixes = [[], [3, 4, 5, 6, 7, 8], [3, 4, 5, 9, 9, 9, 9, 9, 9, 9, 9]]
    arrivals = []
    for _ in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(st.integers(3, 12), min_size=1, max_size=MAX_PROMPT - len(prefix)))
        arrivals.append(
            Arrival(
                step=draw(st.integers(0, 12)),
                prompt=prefix + suffix,
                max_tokens=draw(st.integers(1, MAX_OUTPUT)),
                priority=draw(st.integers(0, 2)),
                ignore_eos=draw(st.booleans()),
                cache_salt=draw(st.sampled_from([None, None, "a"])),
            )
        )
    aborts: dict[int, list[int]] = {}
    for _ in range(draw(st.integers(0, 3))):
        aborts.setdefault(draw(st.integers(0, 30)), []).append(
            draw(st.integers(0, len(arrivals) - 1))
        )
    return scheduler, arrivals, aborts


def expected_tokens(request_id: str, arrival: Arrival) -> list[int]:
    tokens: list[int] = []
    while True:
        token = token_for(request_id, len(arrival.prompt) + len(tokens))
        tokens.append(token)
        if token == EOS and not arrival.ignore_eos:
            return tokens
        if len(tokens) >= arrival.max_tokens or len(arrival.prompt) + len(tokens) >= MAX_MODEL_LEN:
            return tokens


def check_invariants(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    owners: Counter[int] = Counter()
    for request_id, blocks in kv.req_to_blocks.items():
        request = scheduler.requests[request_id]
        assert len(set(blocks)) == len(blocks), "a block twice in one table"
        if request.status is not RequestStatus.RUNNING:
            assert blocks == [], "a waiting request holds blocks"
        assert len(blocks) * kv.block_size >= request.num_computed_tokens
        for index, block in enumerate(blocks):
            assert block != 0, "the null block was handed out"
            owners[block] += 1
            block_hash = pool.block_hash(block)
            if block_hash is not None and index < len(request.block_hashes):
                assert request.block_hashes[index] == block_hash, "wrong cached block"
    for entries in scheduler.pending_frees.values():  # finished or preempted, a step in flight
        for blocks, _, _ in entries:
            for block in blocks:
                owners[block] += 1
    free = set(pool.free_block_ids())
    assert len(free) == pool.num_free_blocks, "a block queued twice"
    for block in range(1, pool.num_blocks):
        assert pool.ref_cnt(block) == owners[block], "ref count differs from owners"
        assert (block in free) == (pool.ref_cnt(block) == 0)
        if owners[block] > 1:
            assert pool.block_hash(block) is not None, "block shared without the prefix cache"
    num_used = sum(1 for block in range(1, pool.num_blocks) if pool.ref_cnt(block) > 0)
    assert pool.num_free_blocks + num_used == pool.num_blocks - 1
    for block_hash in pool.cached_hashes():
        block = pool.get_cached_block(block_hash)
        assert block is not None and pool.block_hash(block) == block_hash
    running, waiting = scheduler.running, list(scheduler.waiting)
    assert len(running) <= scheduler.scheduler_config.max_num_seqs
    assert all(r.status is RequestStatus.RUNNING for r in running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in waiting)
    assert all(r.num_computed_tokens == 0 for r in waiting)
    assert {r.request_id for r in running + waiting} == set(scheduler.requests)
    assert len(running) + len(waiting) == len(scheduler.requests)


def arrive_and_abort(
    scheduler: Scheduler, arrivals: list[Arrival], aborts: dict[int, list[int]], step: int
) -> list[Request]:
    """Add the requests arriving at ``step``, then abort those due; returns the aborted ones."""
    for index, arrival in enumerate(arrivals):
        if arrival.step == step:
            scheduler.add_request(
                make_request(
                    f"r{index}",
                    arrival.prompt,
                    max_tokens=arrival.max_tokens,
                    priority=arrival.priority,
                    arrival_time=float(step),
                    ignore_eos=arrival.ignore_eos,
                    cache_salt=arrival.cache_salt,
                )
            )
    abort_ids = [f"r{i}" for i in aborts.get(step, [])]
    return scheduler.finish_requests(abort_ids, RequestStatus.FINISHED_ABORTED)


def check_model_tokens(arrivals: list[Arrival], outputs: dict[str, list[EngineCoreOutput]]) -> None:
    """Every request streamed the fake model's tokens, one final output last, and ended as it
    should: aborted (a prefix of them), by eos (stop) or by its length."""
    for index, arrival in enumerate(arrivals):
        request_id = f"r{index}"
        request_outputs = outputs[request_id]
        reasons = [o.finish_reason for o in request_outputs]
        assert reasons[-1] is not None and all(r is None for r in reasons[:-1])
        tokens = [t for o in request_outputs for t in o.new_token_ids]
        expected = expected_tokens(request_id, arrival)
        if reasons[-1] == "abort":
            assert tokens == expected[: len(tokens)]
        else:
            assert tokens == expected
            last = expected[-1]
            assert reasons[-1] == ("stop" if last == EOS and not arrival.ignore_eos else "length")


# (the block-arrays fixture is the same for every example: a setting, not state)
SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@settings(max_examples=120, **SETTINGS)  # type: ignore[arg-type]
@given(scenarios())
def test_random_workloads_keep_invariants_and_produce_the_model_tokens(
    scenario: tuple[Scheduler, list[Arrival], dict[int, list[int]]],
) -> None:
    scheduler, arrivals, aborts = scenario
    worker = FakeWorker(scheduler.block_size, token_for)
    outputs: dict[str, list[EngineCoreOutput]] = {}
    last_arrival = max(a.step for a in arrivals)
    budget = scheduler.scheduler_config.token_budget
    for step in range(MAX_STEPS):
        finished = arrive_and_abort(scheduler, arrivals, aborts, step)
        for client_outputs in group_final_outputs(finished).values():
            for output in client_outputs:
                outputs.setdefault(output.request_id, []).append(output)
        check_invariants(scheduler)
        if step > last_arrival and not scheduler.has_requests():
            break
        scheduled = scheduler.schedule()
        assert scheduled.total_num_scheduled_tokens <= budget
        assert all(n > 0 for n in scheduled.num_scheduled_tokens.values())
        assert len(scheduled.num_scheduled_tokens) <= scheduler.scheduler_config.max_num_seqs
        result = worker.execute(scheduled.to_message())
        for client_outputs in scheduler.update_from_output(scheduled, result).values():
            for output in client_outputs:
                outputs.setdefault(output.request_id, []).append(output)
        check_invariants(scheduler)
    else:
        raise AssertionError("requests did not finish")
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.num_blocks - 1
    stats = scheduler.make_stats()
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    check_model_tokens(arrivals, outputs)


def check_in_flight(pipeline: Pipeline) -> bool:
    """No block an outstanding step writes is free or another's; none of them is cached; each
    request's in-flight counts match the outstanding steps that carry it."""
    scheduler = pipeline.scheduler
    kv = scheduler.kv_cache_manager
    num_steps: Counter[Request] = Counter()
    for step, written in pipeline.outstanding:
        for request_id, block_ids in written.items():
            request = step.requests[request_id]
            num_steps[request] += 1
            pending = scheduler.pending_frees.get(request, [])
            held = {block for blocks, _, _ in pending for block in blocks}
            if scheduler.requests.get(request_id) is request:
                held.update(kv.get_block_ids(request_id))
            free = set(kv.block_pool.free_block_ids())
            for block_id in block_ids:
                assert block_id in held, "a block freed while an in-flight step may write it"
                assert kv.block_pool.ref_cnt(block_id) > 0 and block_id not in free
                assert kv.block_pool.block_hash(block_id) is None, (
                    "a block cached before its KV landed"
                )
    for request in list(scheduler.requests.values()) + list(scheduler.pending_frees):
        assert request.num_in_flight_steps == num_steps[request]
        assert 0 <= request.num_stale_steps <= request.num_in_flight_steps
        assert 0 <= request.num_output_placeholders <= request.num_in_flight_steps
    for request in scheduler.pending_frees:
        assert request.num_in_flight_steps > 0, "blocks kept with no step in flight"
    return any(request.num_stale_steps for request in num_steps)


@settings(max_examples=80, **SETTINGS)  # type: ignore[arg-type]
@given(scenarios(async_scheduling=True))
def test_random_workloads_with_two_steps_in_flight(
    scenario: tuple[Scheduler, list[Arrival], dict[int, list[int]]],
) -> None:
    scheduler, arrivals, aborts = scenario
    pipeline = Pipeline(scheduler, FakeWorker(scheduler.block_size, token_for), depth=2)
    last_arrival = max(a.step for a in arrivals)
    stale = False
    for step in range(MAX_STEPS):
        finished = arrive_and_abort(scheduler, arrivals, aborts, step)
        pipeline.record(group_final_outputs(finished))
        check_invariants(scheduler)
        stale |= check_in_flight(pipeline)
        if step > last_arrival and not scheduler.has_requests() and not pipeline.outstanding:
            break
        if len(pipeline.outstanding) < 2 and scheduler.has_requests():  # as Pipeline.advance
            scheduled = pipeline.schedule()
            check_invariants(scheduler)
            stale |= check_in_flight(pipeline)
            if scheduled is not None and len(pipeline.outstanding) < 2:
                continue
        if pipeline.outstanding:
            pipeline.land()
            check_invariants(scheduler)
            stale |= check_in_flight(pipeline)
    else:
        raise AssertionError("requests did not finish")
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.num_blocks - 1
    assert not scheduler.pending_frees
    event(f"preempted: {scheduler.num_preemptions > 0}")
    event(f"preempted with a step in flight: {stale}")
    event(f"prefix hits: {scheduler.kv_cache_manager.prefix_cache_hits > 0}")
    check_model_tokens(arrivals, pipeline.outputs)
