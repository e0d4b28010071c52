"""The offload tiers' KV events (``tiers.tier_events``) on the in-memory bus and a real NATS
server: the CPU tier and the fs tier publish a snapshot when they start and attach, the chunks
a store made readable (medium, block hashes without the group index, tokens per chunk) and
those a store evicted; the object tier (real nats-server) names the chunks its bucket already
held in its snapshot at attach, then its stores and evictions; a client following the
kv-events stream indexes them; a tier of a deployment that does not route by prefix publishes
nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shoal.bus.base import Bus
from shoal.bus.codec import Codec
from shoal.bus.messages.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from shoal.bus.msg import Msg
from shoal.bus.subjects import Subjects
from shoal.bus.transport.nats_bus import NatsBus
from shoal.config.deployment import ShoalConfig
from shoal.engine.client.prefix_routing import PrefixRouting
from shoal.tiers.books.keys import get_offload_block_hash
from tests.actors.test_cpu_tier_actor import LAYOUT, Deployment, K
from tests.actors.test_fs_tier_actor import Harness, done, key
from tests.actors.test_obj_tier_actor import ObjHarness, harness_on
from tests.fixtures.nats import BusFactory
from tests.integration.conditions import wait_for

LIMIT_S = 10.0
_BATCH: Codec[KVEventBatch] = Codec(KVEventBatch)


class Heard:
    """Every tier KV-events batch published in a namespace, in order."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    @classmethod
    async def on(cls, bus: Bus, namespace: str) -> Heard:
        heard = cls()

        async def on_batch(msg: Msg) -> None:
            heard.batches.append(_BATCH.decode(msg.data))

        await bus.subscribe(Subjects(namespace).tier_kv_events("*"), on_batch, sequential=True)
        await bus.flush()
        return heard

    def events(self) -> list[KVEvent]:
        return [event for batch in self.batches for event in batch.events]

    async def wait(self, what: str, count: int = 1) -> None:
        await wait_for(lambda: len(self.batches) >= count, LIMIT_S, what)

    async def started(self, tier_id: str) -> None:
        """The first batch came: the tier's empty snapshot as it starts (nothing attached)."""
        await self.wait("the snapshot of a tier that starts")
        assert self.batches[0].events == [AllBlocksCleared()]
        assert self.batches[0].engine_id == tier_id


def stored(heard: Heard) -> list[bytes]:
    return [h for e in heard.events() if isinstance(e, BlockStored) for h in e.block_hashes]


def hashes(*keys: bytes) -> list[bytes]:
    return [get_offload_block_hash(k) for k in keys]


@pytest.fixture
async def deployment(bus_factory: BusFactory, tmp_path: Path) -> AsyncIterator[Deployment]:
    d = Deployment(await bus_factory(), tmp_path)
    yield d
    for actor in reversed(d.actors):
        await actor.stop()


@pytest.fixture
async def h(bus_factory: BusFactory, tmp_path: Path) -> AsyncIterator[Harness]:
    harness = Harness(await bus_factory(), await bus_factory(), tmp_path)
    yield harness
    await harness.close()


@pytest.fixture
async def obj_h(nats_url: str, tmp_path: Path) -> AsyncIterator[ObjHarness]:
    async for harness in harness_on([NatsBus([nats_url]), NatsBus([nats_url])], tmp_path):
        yield harness


CHUNK_TOKENS = LAYOUT.block_size * LAYOUT.blocks_per_chunk


async def test_the_cpu_tier_publishes_its_snapshot_stores_and_evictions(deployment) -> None:
    heard = await Heard.on(deployment.bus, deployment.namespace)
    tier = await deployment.start_tier(
        deployment.kv_config(num_slots=2), kv_events_snapshot_interval_s=30.0
    )
    await heard.wait("the snapshot of a tier that starts")
    first = heard.batches[0]
    assert (first.engine_id, first.incarnation, first.seq) == (tier.actor_id, tier.incarnation, 0)
    assert first.events == [AllBlocksCleared()]
    region = await deployment.attach()
    await heard.wait("the snapshot of its new region", 2)
    await deployment.store(region, K[0])
    await deployment.store(region, K[1])
    await wait_for(lambda: stored(heard) == hashes(K[0], K[1]), LIMIT_S, "the stores")
    assert {(e.block_size, e.medium) for e in heard.events() if isinstance(e, BlockStored)} == {
        (CHUNK_TOKENS, "cpu")
    }
    await deployment.store(region, K[2])  # the tier is full: the least recent leaves
    await wait_for(lambda: BlockRemoved in map(type, heard.events()), LIMIT_S, "the eviction")
    assert [e for e in heard.events() if isinstance(e, BlockRemoved)] == [
        BlockRemoved(hashes(K[0]), "cpu")
    ]
    assert [b.seq for b in heard.batches] == list(range(len(heard.batches)))
    assert len(heard.batches) <= 5  # coalesced: a batch per flush that changed something


async def test_a_client_following_the_stream_indexes_the_cpu_tiers_chunks(deployment) -> None:
    config = ShoalConfig.from_options(model="m", routing_mode="kv")
    tier = await deployment.start_tier(
        deployment.kv_config(num_slots=4), kv_events_snapshot_interval_s=30.0
    )
    region = await deployment.attach()
    await deployment.store(region, K[0], K[1])
    routing = PrefixRouting(deployment.bus, Subjects(deployment.namespace), config)
    await routing.start()  # started later: replays what the stream kept
    try:
        await wait_for(
            lambda: routing.index.hashes_of(tier.actor_id, "cpu") == set(hashes(K[0], K[1])),
            LIMIT_S,
            "the tier's chunks in the client's index",
        )
    finally:
        await routing.stop()


async def test_a_tier_of_a_deployment_routing_by_load_publishes_nothing(deployment) -> None:
    heard = await Heard.on(deployment.bus, deployment.namespace)
    tier = await deployment.start_tier(deployment.kv_config(num_slots=2))
    assert tier.kv_events is None
    region = await deployment.attach()
    await deployment.store(region, K[0], K[1])
    await deployment.store(region, K[2])  # and an eviction
    await asyncio.sleep(0.3)
    assert heard.batches == []
    assert tier.books is not None and tier.books.manager.take_events() == []  # none logged


async def test_the_fs_tier_publishes_its_snapshot_stores_and_evictions(h: Harness) -> None:
    heard = await Heard.on(h.client, h.namespace)
    tier = await h.tier(num_chunks=2, kv_events_snapshot_interval_s=30.0)
    await heard.started(tier.actor_id)
    await h.attach()
    await heard.wait("the snapshot of its layout", 2)
    h.fill([0, 1, 2], [1, 2, 3])
    assert await h.cascade([1], [0]) == done(1)
    assert await h.cascade([2], [1]) == done(2)
    await wait_for(lambda: stored(heard) == hashes(key(1), key(2)), LIMIT_S, "the stores")
    fs_chunk_tokens = h.region.ref.layout.block_size * h.region.ref.layout.blocks_per_chunk
    assert {(e.block_size, e.medium) for e in heard.events() if isinstance(e, BlockStored)} == {
        (fs_chunk_tokens, "fs")
    }
    assert await h.cascade([3], [2]) == done(3)  # over budget: the least recent leaves
    await wait_for(lambda: BlockRemoved in map(type, heard.events()), LIMIT_S, "the eviction")
    assert [e for e in heard.events() if isinstance(e, BlockRemoved)] == [
        BlockRemoved(hashes(key(1)), "fs")
    ]


async def test_the_obj_tier_publishes_its_snapshot_stores_and_evictions(obj_h: ObjHarness) -> None:
    """On a real nats-server: a tier on a bucket an earlier one filled names its chunks in the
    snapshot of its attach; then its own stores, and what its budget evicts."""
    h = obj_h
    first = await h.tier(num_chunks=3)  # publishes nothing (no interval)
    await h.attach()
    h.fill([0, 1, 2, 3], [1, 2, 3, 4])
    for i in (1, 2):  # stored in this order: 1 is the oldest
        assert await h.cascade([i], [i - 1]) == done(i)
    await first.stop()
    heard = await Heard.on(h.client, h.namespace)
    tier = await h.tier(num_chunks=3, kv_events_snapshot_interval_s=30.0)
    await heard.started(tier.actor_id)
    await h.attach()
    await heard.wait("the snapshot of its layout", 2)
    chunk_tokens = h.region.ref.layout.block_size * h.region.ref.layout.blocks_per_chunk
    assert heard.batches[1].events == [
        AllBlocksCleared(),
        BlockStored(hashes(key(1), key(2)), None, chunk_tokens, "obj"),
    ]
    assert await h.cascade([3], [2]) == done(3)
    await wait_for(lambda: stored(heard)[-1:] == hashes(key(3)), LIMIT_S, "the store")
    assert heard.batches[-1].events == [BlockStored(hashes(key(3)), None, chunk_tokens, "obj")]
    assert await h.cascade([4], [3]) == done(4)  # over budget: the least recent leaves
    await wait_for(lambda: BlockRemoved in map(type, heard.events()), LIMIT_S, "the eviction")
    assert [e for e in heard.events() if isinstance(e, BlockRemoved)] == [
        BlockRemoved(hashes(key(1)), "obj")
    ]
    assert stored(heard)[-1:] == hashes(key(4))
    assert [b.seq for b in heard.batches] == list(range(len(heard.batches)))
