"""Async scheduling through the real actors on the in-memory bus: the same outputs with async on
and off (mixed lengths, chunked prefill, n > 1, stop strings and tokens, prefix-cache hits,
preemption in a tiny pool, an abort), exactly ``prompt + max_tokens - 1`` tokens scheduled per
request, two steps really in flight, and a failed step while another is in flight."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.messages.worker import ExecuteStep, StepResult
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.engine.actor.core_actor import EngineCoreActor
from tests.fixtures.models import make_prompts
from tests.integration.async_workload import (
    MAX_TOKENS,
    Results,
    complete,
    greedy,
    run_all,
    run_batch,
)
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import EngineStack, engine_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

BUDGET = 64  # tokens per step: the 300-token prompt is prefilled in chunks


async def _memory_bus() -> InMemoryBus:
    bus = InMemoryBus(InMemoryBroker())
    await bus.connect()
    return bus


def _stack(bus: InMemoryBus, model_dir: Path, async_on: bool, **options: Any) -> Any:
    options.setdefault("max_num_batched_tokens", BUDGET)
    return engine_stack(bus, model_dir, async_scheduling=async_on, **options)


def _stats(stack: EngineStack) -> SchedulerStats:
    engine: EngineCoreActor = stack.engines[0]
    assert engine.core is not None
    stats = engine.stats()
    assert stats is not None
    return stats


async def _settled(stack: EngineStack) -> SchedulerStats:
    """The stats once the engine core runs nothing and has no step in flight."""
    core = stack.engines[0].core
    assert core is not None
    await wait_for(lambda: not core.has_work(), 60, "the engine core settles")
    return _stats(stack)


async def _run(model_dir: Path, async_on: bool, **options: Any) -> tuple[Results, SchedulerStats]:
    bus = await _memory_bus()
    try:
        async with _stack(bus, model_dir, async_on, **options) as stack:
            results = await run_all(stack.client)
            return results, await _settled(stack)
    finally:
        await bus.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sync_run(tiny_checkpoint) -> tuple[Results, SchedulerStats]:  # type: ignore[no-untyped-def]
    """The workload with async off, the reference for every comparison."""
    results, stats = await _run(tiny_checkpoint("llama"), False)
    assert stats.max_steps_in_flight == 1
    return results, stats


def _finished(stats: SchedulerStats) -> tuple[int, ...]:
    s = stats
    return (s.num_finished_stop, s.num_finished_length, s.num_finished_abort, s.num_finished_error)


async def test_outputs_equal_with_async_on_and_off(tiny_checkpoint, sync_run):  # type: ignore[no-untyped-def]
    sync_results, sync_stats = sync_run
    results, stats = await _run(tiny_checkpoint("llama"), True)
    assert results == sync_results
    assert stats.max_steps_in_flight == 2  # two steps were really in flight
    assert stats.prefix_cache_hits == sync_stats.prefix_cache_hits > 0
    # The victim and the stop string (the client aborts it) end by abort; none by error.
    assert _finished(stats) == _finished(sync_stats)
    assert (stats.num_finished_abort, stats.num_finished_error) == (2, 0)
    assert (stats.num_steps_in_flight, stats.num_running, stats.num_waiting) == (0, 0, 0)


async def test_preemption_in_a_tiny_pool_keeps_the_outputs(tiny_checkpoint, sync_run):  # type: ignore[no-untyped-def]
    """24 blocks of 16 tokens for a batch that needs far more: requests are preempted and
    recomputed, with a step in flight, and still produce the same tokens."""
    bus = await _memory_bus()
    try:
        async with _stack(bus, tiny_checkpoint("llama"), True, num_blocks=24) as stack:
            results = await run_batch(stack.client, victim_tokens=200)
            stats = await _settled(stack)
    finally:
        await bus.close()
    assert stats.num_preemptions > 0
    assert stats.max_steps_in_flight == 2
    # Greedy outputs only: a seeded request preempted with a step in flight has drawn once
    # more from its generator in that (stale) step, so its random stream goes on shifted.
    greedy_ids = [k for k in results if k != "seeded"]
    assert {k: results[k] for k in greedy_ids} == {k: sync_run[0][k] for k in greedy_ids}
    assert stats.num_free_blocks == 24 - 1  # every block back (the null block aside)


@pytest.mark.parametrize("async_on", [True, False])
async def test_each_request_is_scheduled_for_prompt_plus_max_tokens_minus_one(
    tiny_checkpoint,  # type: ignore[no-untyped-def]
    async_on: bool,
) -> None:
    """No step past max_tokens: outputs end at exactly max_tokens, and the engine core scheduled
    exactly prompt + max_tokens - 1 tokens per request (no cache hits, no preemption)."""
    prompts = make_prompts()
    bus = await _memory_bus()
    try:
        async with _stack(
            bus, tiny_checkpoint("llama"), async_on, enable_prefix_caching=False
        ) as stack:
            finals = await asyncio.gather(
                *(
                    complete(stack.client, p, greedy(m), f"r{i}")
                    for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS, strict=True))
                )
            )
            stats = await _settled(stack)
    finally:
        await bus.close()
    assert [len(f.outputs[0].token_ids) for f in finals] == list(MAX_TOKENS)
    assert stats.num_preemptions == 0
    want = sum(len(p) + m - 1 for p, m in zip(prompts, MAX_TOKENS, strict=True))
    assert stats.num_scheduled_tokens == want
    assert stats.max_steps_in_flight == (2 if async_on else 1)


async def test_a_failed_step_with_another_in_flight(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The worker raises on one step while the next is already sent: the requests of both steps
    end with an error, nothing hangs, and the engine serves again."""
    bus = await _memory_bus()
    try:
        # fault tolerance off: the failed step's requests end (on, they would resume)
        model_dir = tiny_checkpoint("llama")
        async with _stack(bus, model_dir, True, enable_fault_tolerance=False) as stack:
            runner = stack.workers[0].runner
            assert runner is not None
            real_execute = runner.execute
            seen: list[tuple[int, list[str]]] = []  # step id, its requests

            def execute(step: ExecuteStep) -> StepResult:
                seen.append((step.step_id, step.batch_order().req_ids))
                if len(seen) == 6:  # both requests are decoding by now
                    raise RuntimeError("injected step failure")
                return real_execute(step)

            runner.execute = execute  # type: ignore[method-assign]
            both = asyncio.gather(
                complete(stack.client, [5, 6, 7], greedy(40), "a"),
                complete(stack.client, [8, 9, 10, 11], greedy(40), "b"),
            )
            finals = await asyncio.wait_for(both, 60)  # nothing hangs
            for final in finals:
                assert final.outputs[0].finish_reason == "error", final
                assert len(final.outputs[0].token_ids) < 40
            stats = await _settled(stack)
            # The next step was sent before the failed one's result was back: it carries the
            # same requests (and fails on the worker too, its state being one token short).
            assert [ids for _, ids in seen[5:7]] == [["a", "b"], ["a", "b"]], seen
            assert (stats.num_finished_error, stats.max_steps_in_flight) == (2, 2)
            assert (stats.num_steps_in_flight, stats.num_free_blocks) == (0, 256 - 1)
            again = await complete(stack.client, [5, 6, 7], greedy(5), "again")
            assert again.outputs[0].finish_reason == "length"
            assert len(again.outputs[0].token_ids) == 5
    finally:
        await bus.close()


async def test_requests_arriving_during_the_first_step_after_idle_join_the_next(tiny_checkpoint):  # type: ignore[no-untyped-def]
    """The first step after the core was idle is landed before the next is scheduled (a burst
    still arriving joins that next step); from then on the step ahead goes out at once."""
    bus = await _memory_bus()
    try:
        async with _stack(bus, tiny_checkpoint("llama"), True) as stack:
            runner = stack.workers[0].runner
            assert runner is not None
            real_execute = runner.execute
            seen: list[tuple[list[str], list[str]]] = []  # each step's new and running requests
            first_running = asyncio.Event()
            loop = asyncio.get_running_loop()

            def execute(step: ExecuteStep) -> StepResult:
                new = [r.req_id for r in step.new_requests]
                seen.append((new, step.batch_order().req_ids))
                if len(seen) == 1:
                    loop.call_soon_threadsafe(first_running.set)
                    time.sleep(0.5)  # the first step runs long: the rest of the burst arrives
                return real_execute(step)

            runner.execute = execute  # type: ignore[method-assign]
            first = asyncio.ensure_future(complete(stack.client, [5, 6, 7], greedy(6), "first"))
            await asyncio.wait_for(first_running.wait(), 30)
            late = [complete(stack.client, [8 + i, 9, 10], greedy(6), f"late{i}") for i in range(3)]
            await asyncio.wait_for(asyncio.gather(first, *late), 60)
            assert seen[0][0] == ["first"]
            # Without the landing, the step sent ahead of the first would carry only "first".
            assert seen[1][0] == ["late0", "late1", "late2"], seen
            stats = await _settled(stack)
            assert stats.max_steps_in_flight == 2  # the steps after it were sent ahead
    finally:
        await bus.close()
