"""Aborts and stop strings reach the engine core when every actor runs in its own process over a
real nats-server (the supervisor runs them). The tests read what the engine core itself
published on its stats subject: requests finished by reason, tokens generated, free KV blocks.

Each victim could only end by abort: it ignores eos and has room for ~1000 tokens."""

from __future__ import annotations

import pytest
import pytest_asyncio

from shoal.bus import connect_bus
from shoal.bus.base import Msg
from shoal.bus.codec import Codec
from shoal.bus.messages.engine import EngineStats, SchedulerStats
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.subjects import Subjects
from shoal.bus.supervisor import ActorSpec, Supervisor
from shoal.deploy.deployment import build_config, plan_actors
from shoal.engine.client.engine_client import AsyncEngineClient
from tests.integration.conditions import (
    CONTEXT_LEN,
    assert_ended_by_abort,
    pick_stop_string,
    read_then_hang_up,
    wait_for,
)

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


class PublishedStats:
    """The latest ``EngineStats`` an engine core published on its stats subject."""

    def __init__(self) -> None:
        self.latest: EngineStats | None = None
        self._codec: Codec[EngineStats] = Codec(EngineStats)

    async def on_msg(self, msg: Msg) -> None:
        self.latest = self._codec.decode(msg.data)

    @property
    def stats(self) -> SchedulerStats:
        assert self.latest is not None
        return self.latest.stats

    def num_finished(self) -> int:
        s = self.stats
        return s.num_finished_stop + s.num_finished_length + s.num_finished_abort


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment(nats_server, tiny_checkpoint):  # type: ignore[no-untyped-def]
    config = build_config(
        model=str(tiny_checkpoint("llama")),
        num_gpu_blocks_override=NUM_BLOCKS,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        namespace=NAMESPACE,
    )
    fast = {"heartbeat_interval_s": 0.2}
    specs = [
        ActorSpec(p.name, p.target, nats_server.url, {**p.kwargs, **fast}, kind=p.kind)
        for p in plan_actors(config)
    ]
    bus = await connect_bus(nats_server.url)
    published = PublishedStats()
    await bus.subscribe(Subjects(NAMESPACE).engine_stats("engine-0"), published.on_msg)
    supervisor = Supervisor(specs, status_bus=bus, namespace=NAMESPACE)
    await supervisor.start()
    client = AsyncEngineClient(bus, config)
    await client.start()
    try:
        await client.wait_until_ready(120)
        await wait_for(lambda: published.latest is not None, 30, "engine stats")
        yield client, published
    finally:
        await client.close()
        await supervisor.stop()
        await bus.close()


async def test_abort_reaches_the_engine_core_process(deployment):  # type: ignore[no-untyped-def]
    client, published = deployment
    before = published.stats
    assert published.num_finished() == 0
    params = SamplingParams(temperature=0.0, max_tokens=ROOM, ignore_eos=True)
    await read_then_hang_up(client.generate(PROMPT, params, "victim"))
    await wait_for(
        lambda: published.num_finished() == 1 and published.stats.num_running == 0,
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
            lambda: published.num_finished() >= num_finished and published.stats.num_running == 0,
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
