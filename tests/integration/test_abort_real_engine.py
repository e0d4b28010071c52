"""Aborts and stop strings reach the engine core when every actor runs in its own process over a
real nats-server (the supervisor runs them). The tests read what the engine core itself
published on its stats subject: requests finished by reason, tokens generated, free KV blocks.

Each victim could only end by abort: it ignores eos and has room for ~1000 tokens."""

from __future__ import annotations

import pytest
import pytest_asyncio

from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.messages.sampling import SamplingParams
from shoal.deploy.deployment import build_config
from tests.integration.conditions import (
    CONTEXT_LEN,
    assert_ended_by_abort,
    pick_stop_string,
    read_then_hang_up,
    wait_for,
)
from tests.integration.process_deployment import process_deployment

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.nats,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
]
NAMESPACE = "abortprocs"
NUM_BLOCKS = 96
PROMPT = [5, 6, 7]
ROOM = CONTEXT_LEN - len(PROMPT)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment(nats_server, tiny_checkpoint):  # type: ignore[no-untyped-def]
    config = build_config(
        model=str(tiny_checkpoint("llama")),
        num_gpu_blocks_override=NUM_BLOCKS,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        namespace=NAMESPACE,
    )
    async with process_deployment(nats_server.url, config) as deployed:
        yield deployed.client, deployed.published


def _idle(stats: SchedulerStats) -> bool:
    """Nothing running and no step in flight (whose blocks a finished request may still hold)."""
    return stats.num_running == 0 and stats.num_steps_in_flight == 0


async def test_abort_reaches_the_engine_core_process(deployment):  # type: ignore[no-untyped-def]
    client, published = deployment
    before = published.stats
    assert published.num_finished() == 0
    params = SamplingParams(temperature=0.0, max_tokens=ROOM, ignore_eos=True)
    await read_then_hang_up(client.generate(PROMPT, params, "victim"))
    await wait_for(
        lambda: published.num_finished() == 1 and _idle(published.stats),
        120,
        "the engine core publishes the victim's end",
    )
    assert before.num_generation_tokens == 0
    assert_ended_by_abort(published.stats, num_blocks=NUM_BLOCKS, max_tokens=ROOM)


async def test_a_stop_string_ends_the_request_in_the_engine_core_process(deployment):  # type: ignore[no-untyped-def]
    client, published = deployment

    async def settled(num_finished: int, what: str) -> SchedulerStats:
        """The engine core's figures once it has finished ``num_finished`` requests and is idle."""
        await wait_for(
            lambda: published.num_finished() >= num_finished and _idle(published.stats),
            120,
            what,
        )
        return published.stats

    num_finished = published.num_finished()
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = [o async for o in client.generate(PROMPT, greedy, "greedy")][-1].outputs[0]
    stop = pick_stop_string(full.text)
    before = await settled(num_finished + 1, "the greedy run ends in the engine core")
    params = SamplingParams(temperature=0.0, max_tokens=ROOM, ignore_eos=True, stop=[stop])
    final = [o async for o in client.generate(PROMPT, params, "stopped")][-1].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == (
        full.text[: full.text.index(stop)],
        "stop",
        stop,
    )
    after = await settled(num_finished + 2, "the stopped request ends in the engine core")
    assert after.num_finished_abort == before.num_finished_abort + 1, after
    assert after.num_finished_length == before.num_finished_length, after
    # The client aborted it in the engine core once the string matched: it generated the tokens
    # up to the match and the few that ran while the abort travelled, far fewer than max_tokens.
    generated = after.num_generation_tokens - before.num_generation_tokens
    assert len(final.token_ids) <= generated < ROOM // 4, (generated, after)
    assert after.num_free_blocks == NUM_BLOCKS - 1
