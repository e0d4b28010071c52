"""Prefix-aware routing through real engine cores (tiny model, two engine cores) on the
in-memory bus and a real nats-server: requests sharing a prefix land on the engine core that
holds it (hits read from the engine cores' own published counters); a restarted client rebuilds
its index from the kv-events stream; a stopped engine core's entries are dropped and its new
incarnation starts empty; greedy outputs do not depend on the routing mode."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.engine.actor.core_actor import EngineCoreActor
from shoal.engine.client.engine_client import AsyncEngineClient
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import EngineStack, engine_stack

pytestmark = pytest.mark.timeout(240)

BLOCK = 4
PREFIX_BLOCKS = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def prompt(group: int, turn: int) -> list[int]:
    """A shared prefix per group (8 full blocks) and a suffix per turn."""
    prefix = [(7 * group + i) % 50 + 3 for i in range(PREFIX_BLOCKS * BLOCK)]
    return prefix + [(group + turn + i) % 50 + 3 for i in range(5)]


def record_picks(client: AsyncEngineClient) -> list[str]:
    picks: list[str] = []
    pick = client.router.pick

    def recording(*args: Any, **kwargs: Any) -> Any:
        view = pick(*args, **kwargs)
        if view is not None:
            picks.append(view.engine_id)
        return view

    client.router.pick = recording  # type: ignore[method-assign]
    return picks


def watch_hits(client: AsyncEngineClient) -> dict[str, SchedulerStats]:
    latest: dict[str, SchedulerStats] = {}
    client.stats_listeners.append(lambda stats, engine_id: latest.__setitem__(engine_id, stats))
    return latest


async def generate(client: AsyncEngineClient, tokens: list[int]) -> list[int]:
    final = None
    async for output in client.generate(tokens, PARAMS, f"r-{uuid.uuid4().hex[:8]}"):
        final = output
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


async def warm_two_groups(stack: EngineStack) -> tuple[str, str]:
    """Group 0 and group 1 go out together: one lands on each engine core (by load)."""
    picks = record_picks(stack.client)
    await asyncio.gather(generate(stack.client, prompt(0, 0)), generate(stack.client, prompt(1, 0)))
    assert sorted(picks) == ["e0", "e1"]
    index = stack.client.router.index
    assert index is not None
    await wait_for(
        lambda: all(len(index.hashes_of(e)) >= PREFIX_BLOCKS for e in picks), 30, "events seen"
    )
    return picks[0], picks[1]


def stack_options() -> dict[str, Any]:
    return {"namespace": f"pr{uuid.uuid4().hex[:8]}", "block_size": BLOCK, "routing_mode": "kv"}


async def test_requests_sharing_a_prefix_land_where_it_is_cached(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    bus = await bus_factory()
    async with engine_stack(
        bus, tiny_checkpoint("llama"), num_engines=2, **stack_options()
    ) as stack:
        owner = await warm_two_groups(stack)
        latest = watch_hits(stack.client)
        before = {e.engine_id: e.core.stats().prefix_cache_hits for e in stack.engines}  # type: ignore[union-attr]
        picks = record_picks(stack.client)
        # A group's turns go out together: routing by load alone would spread each group over
        # both engine cores (every second pick of a group is the other, less loaded one), so
        # only prefix routing (8 cached blocks outweigh a load of up to 3) keeps them together.
        turns = [(group, turn) for group in (0, 1) for turn in range(1, 4)]
        await asyncio.gather(*(generate(stack.client, prompt(g, t)) for g, t in turns))
        assert picks == [owner[g] for g, _ in turns]
        ideal = len(turns) * PREFIX_BLOCKS * BLOCK
        await wait_for(
            lambda: (
                sum(s.prefix_cache_hits for s in latest.values()) - sum(before.values()) >= ideal
            ),
            30,
            "the engine cores' published hits",
        )
        hits = sum(s.prefix_cache_hits for s in latest.values()) - sum(before.values())
        assert hits == ideal


async def test_a_restarted_client_rebuilds_its_index_from_the_stream(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    bus = await bus_factory()
    async with engine_stack(
        bus, tiny_checkpoint("llama"), num_engines=2, **stack_options()
    ) as stack:
        owner = await warm_two_groups(stack)
        old = stack.client.router.index
        assert old is not None
        await stack.client.close()
        client = AsyncEngineClient(bus, stack.engines[0].config)
        await client.start()  # replays the stream before routing
        stack.client = client
        index = client.router.index
        assert index is not None and index is not old
        for engine_id in ("e0", "e1"):
            assert index.hashes_of(engine_id) == old.hashes_of(engine_id)
        await client.wait_until_ready(30, 2)
        picks = record_picks(client)
        for turn in (1, 2):
            for group in (0, 1):
                await generate(client, prompt(group, turn))
        assert picks == [owner[0], owner[1], owner[0], owner[1]]


async def test_a_stopped_engine_core_is_dropped_and_its_new_life_starts_empty(
    bus_factory,  # type: ignore[no-untyped-def]
    tiny_checkpoint,
) -> None:
    bus = await bus_factory()
    async with engine_stack(
        bus, tiny_checkpoint("llama"), num_engines=2, **stack_options()
    ) as stack:
        owner = await warm_two_groups(stack)
        index = stack.client.router.index
        assert index is not None
        rank = int(owner[1][1:])
        old = stack.engines[rank]
        await old.stop()
        await wait_for(lambda: not index.hashes_of(owner[1]), 30, "stopped engine dropped")
        assert index.hashes_of(owner[0])  # the other one keeps its entries
        new = EngineCoreActor(
            bus, owner[1], config=old.config, worker_ids=[f"w{rank}"], heartbeat_interval_s=0.2
        )
        await new.start()
        stack.engines[rank] = new
        await wait_for(
            lambda: index.incarnation_of(owner[1]) == new.incarnation, 30, "new life followed"
        )
        assert not index.hashes_of(owner[1])  # a fresh cache
        await stack.client.wait_until_ready(30, 2)
        picks = record_picks(stack.client)
        await generate(stack.client, prompt(0, 5))
        assert picks == [owner[0]]  # group 0 still goes to its owner


async def test_greedy_outputs_do_not_depend_on_the_routing_mode(tiny_checkpoint, hf_reference):  # type: ignore[no-untyped-def]
    """On the in-memory bus only (the routing mode changes no bus behaviour): both modes give
    transformers' greedy tokens."""
    model_dir = tiny_checkpoint("llama")
    prompts = [prompt(g, turn) for turn in range(3) for g in (0, 1)]
    want = hf_reference(model_dir, prompts, PARAMS.max_tokens)
    for mode in ("kv", "load"):
        bus = InMemoryBus(InMemoryBroker())
        await bus.connect()
        options = {**stack_options(), "routing_mode": mode}
        try:
            async with engine_stack(bus, model_dir, num_engines=2, **options) as stack:
                runs = []
                for turn in range(3):
                    pair = (generate(stack.client, prompt(g, turn)) for g in (0, 1))
                    runs.extend(await asyncio.gather(*pair))
        finally:
            await bus.close()
        assert runs == want, mode
