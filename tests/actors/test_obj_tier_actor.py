"""The object-store tier actor on the in-memory bus's object store and a real nats-server's,
driven as the CPU tier drives it: attach, cascade region slots to objects, look up, promote
objects back into slots.

Round trip of the bytes; the byte budget evicts (objects deleted) least recently used first; a
damaged or missing object is a miss, removed, and the keys after it are not returned; a new actor
on the same bucket rebuilds its index from the bucket (incomplete chunks removed); cascades past
the queue bound are dropped at once while a write is held up; a job past its deadline touches no
slot; on a NATS server without JetStream the attach is refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from shoal.bus.base import Bus
from shoal.bus.buckets import ObjectStore
from shoal.bus.jetstream.object_store import NatsObjectStore
from shoal.bus.messages.offload import SecondaryAttached, TierAttach, TierCascade, TierError
from shoal.bus.nats_ops.server import NatsServer
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.bus.transport.nats_bus import NatsBus
from shoal.config.deployment import ObjTierConfig
from shoal.tiers.secondary.obj_actor import ObjTierActor
from shoal.tiers.secondary.obj_store import ObjectChunks
from tests.actors.test_fs_tier_actor import LAYOUT, NUM_SLOTS, REPLY_S, Harness, done, key, pattern
from tests.integration.conditions import wait_for

SIZE = LAYOUT.slot_bytes


class ObjHarness(Harness):
    """The fs tier's harness with object tier actors (the bucket is the namespace's own)."""

    tier_id = "kv-cpu-obj0"

    async def tier(self, num_chunks: int = 6, **options: Any) -> ObjTierActor:  # type: ignore[override]
        config = ObjTierConfig(bytes_to_use=num_chunks * SIZE)
        options.setdefault("heartbeat_interval_s", 0.05)
        options.setdefault("drain_timeout_s", 0.5)
        actor = ObjTierActor(
            self.bus, self.tier_id, tier_config=config, namespace=self.namespace, **options
        )
        await actor.start()
        self.actors.append(actor)
        return actor

    async def names(self) -> set[str]:
        store = await self.client.open_object_store(f"shoal_kv_{self.namespace}")
        return {entry.name for entry in await store.list()}


async def harness_on(buses: list[Bus], tmp_path: Path) -> AsyncIterator[ObjHarness]:
    for bus in buses:
        await bus.connect()
    harness = ObjHarness(buses[0], buses[1], tmp_path)
    yield harness
    await harness.close()
    for bus in buses:
        await bus.close()


@pytest.fixture
async def h(
    bus_kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[ObjHarness]:
    """A harness on the in-memory bus (its actor and client on one broker) or on NATS."""
    if bus_kind == "memory":
        broker = InMemoryBroker()
        buses: list[Bus] = [InMemoryBus(broker), InMemoryBus(broker)]
    else:
        url = request.getfixturevalue("nats_url")
        buses = [NatsBus([url]), NatsBus([url])]
    async for harness in harness_on(buses, tmp_path):
        yield harness


@pytest.fixture
async def nats_h(nats_url: str, tmp_path: Path) -> AsyncIterator[ObjHarness]:
    async for harness in harness_on([NatsBus([nats_url]), NatsBus([nats_url])], tmp_path):
        yield harness


def chunks_of(tier: ObjTierActor) -> ObjectChunks:
    assert tier.store is not None
    return tier.store


def object_names(tier: ObjTierActor, *ids: int) -> set[str]:
    return {chunks_of(tier).name(key(i), r) for i in ids for r in range(LAYOUT.tp_size)}


async def test_cascade_then_promote_round_trips_the_bytes(h: ObjHarness) -> None:
    tier = await h.tier()
    assert await h.attach() == SecondaryAttached(0, 0.0)
    h.fill([0, 1, 2], [1, 2, 3])
    assert await h.cascade([1, 2, 3], [0, 1, 2]) == done(1, 2, 3)
    assert await h.held(1, 2, 3, 9) == 3
    assert await h.names() == object_names(tier, 1, 2, 3)  # one object per chunk and rank
    for slot_id in range(NUM_SLOTS):
        h.region.slot(slot_id)[:] = bytes(SIZE)

    assert await h.promote([1, 2, 3, 9], [5, 6, 7, 4]) == done(1, 2, 3, failed=(9,))
    assert [h.slot(s) for s in (5, 6, 7)] == [pattern(i, SIZE) for i in (1, 2, 3)]
    assert h.slot(4) == bytes(SIZE)
    load = tier.load()
    assert (load["num_chunks_stored"], load["num_chunks_loaded"]) == (3, 3)


async def test_the_budget_evicts_the_least_recently_used_objects(h: ObjHarness) -> None:
    tier = await h.tier(num_chunks=2)
    await h.attach()
    h.fill([0, 1, 2], [1, 2, 3])
    assert await h.cascade([1], [0]) == done(1)
    assert await h.cascade([2], [1]) == done(2)
    assert await h.promote([1], [4]) == done(1)  # 1 is used again: 2 is the oldest now
    assert await h.cascade([3], [2]) == done(3)
    assert await h.held(2) == 0 and await h.held(1) == 1 and await h.held(3) == 1
    assert await h.names() == object_names(tier, 1, 3)
    assert tier.load()["num_chunks_evicted"] == 1


async def damage_payload(store: ObjectStore, name: str) -> None:
    raw = await store.get(name)
    assert raw is not None
    raw = bytearray(raw)
    raw[-1] ^= 0x80  # a well-formed object (its own SHA-256 fits) with a wrong payload
    await store.put(name, bytes(raw))


@pytest.mark.parametrize("damage", ["payload", "missing", "foreign"])
async def test_a_damaged_object_is_a_miss_and_removed(h: ObjHarness, damage: str) -> None:
    tier = await h.tier()
    await h.attach()
    h.fill([0, 1, 2], [1, 2, 3])
    assert await h.cascade([1, 2, 3], [0, 1, 2]) == done(1, 2, 3)
    chunks = chunks_of(tier)
    if damage == "payload":
        await damage_payload(chunks.store, chunks.name(key(2), 1))
    elif damage == "missing":
        await chunks.store.delete(chunks.name(key(2), 0))
    else:  # another chunk's object under this one's name
        other = await chunks.store.get(chunks.name(key(3), 0))
        assert other is not None
        await chunks.store.put(chunks.name(key(2), 0), bytes(other))

    assert await h.promote([1, 2, 3], [4, 5, 6]) == done(1, failed=(2, 3))
    assert h.slot(4) == pattern(1, SIZE)
    assert await h.held(2) == 0 and await h.held(3) == 1
    assert await h.names() == object_names(tier, 1, 3)  # every part of 2 removed
    assert tier.load()["num_chunks_corrupt"] == 1


async def test_a_new_actor_on_the_bucket_rebuilds_its_index(h: ObjHarness) -> None:
    first = await h.tier()
    await h.attach()
    h.fill([0, 1, 2], [1, 2, 3])
    for i in (2, 1, 3):  # stored in this order: 2 is the oldest
        assert await h.cascade([i], [i - 1]) == done(i)
    chunks = chunks_of(first)
    await chunks.store.delete(chunks.name(key(3), 1))  # 3 lost a part: incomplete
    await first.stop()

    second = await h.tier(num_chunks=1)  # a smaller budget: the older of 2 and 1 goes
    assert await h.attach() == SecondaryAttached(1, 1.0)
    assert await h.held(1) == 1 and await h.held(2) == 0 and await h.held(3) == 0
    assert await h.names() == object_names(second, 1)
    regen = h.make_region(LAYOUT, "g2")  # the CPU tier restarted too: a new region
    assert await h.promote([1], [0], ref=regen.ref) == done(1)
    assert h.slot(0, regen) == pattern(1, SIZE)


async def test_cascades_past_the_bound_are_dropped_while_a_write_is_held(h: ObjHarness) -> None:
    tier = await h.tier(max_queued_cascades=2)
    await h.attach()
    h.fill([0, 1, 2, 3], [1, 2, 3, 4])
    assert await h.cascade([1], [0]) == done(1)
    release, entered = asyncio.Event(), asyncio.Event()
    chunks = chunks_of(tier)
    real = chunks.write_chunk

    async def held_write(key: bytes, slot: memoryview, deadline: float = 0.0) -> None:
        entered.set()
        await asyncio.wait_for(release.wait(), REPLY_S)
        await real(key, slot, deadline)

    chunks.write_chunk = held_write  # type: ignore[method-assign]
    first = asyncio.create_task(h.cascade([2], [1]))
    await asyncio.wait_for(entered.wait(), REPLY_S)
    second = asyncio.create_task(h.cascade([3], [2]))
    await wait_for(lambda: tier.num_cascades_queued == 2, REPLY_S, "the second cascade queued")

    assert await h.cascade([4], [3], timeout=1.0) == done(failed=(4,))  # past the bound: at once
    assert await h.promote([1], [5], timeout=1.0) == done(1)  # loads go on
    assert tier.load()["num_chunks_dropped"] == 1
    release.set()
    assert await first == done(2) and await second == done(3)
    assert await h.held(1, 2, 3, 4) == 3


async def test_past_its_deadline_a_job_stores_nothing_and_touches_no_slot(h: ObjHarness) -> None:
    tier = await h.tier()
    await h.attach()
    h.fill([0], [1])
    late = await h.ask(TierCascade(h.region.ref, [key(1)], [0], deadline=1.0))
    assert late == done(failed=(1,)) and await h.names() == set()
    assert await h.cascade([1], [0]) == done(1)
    h.region.slot(3)[:] = bytes(SIZE)
    chunks = chunks_of(tier)
    with pytest.raises(Exception, match="deadline passed"):
        await chunks.read_chunk(key(1), h.region.slot(3), deadline=1.0)
    assert h.slot(3) == bytes(SIZE)


async def test_a_stopped_tier_waits_for_its_stores_clean_ups(nats_h: ObjHarness) -> None:
    """Stopping the tier closes its object store: the purges and consumer deletes still
    running are waited for (within the store's bound), not left to a closed connection."""
    h = nats_h
    tier = await h.tier()
    await h.attach()
    h.fill([0], [1])
    assert await h.cascade([1], [0]) == done(1)
    assert await h.promote([1], [4]) == done(1)
    store = chunks_of(tier).store
    assert isinstance(store, NatsObjectStore)
    closed: list[float] = []
    real = store.close

    async def close(timeout: float = 1.0) -> None:
        closed.append(timeout)
        await real(timeout)

    store.close = close  # type: ignore[method-assign]
    await tier.stop()
    assert closed and not store._purges


async def test_without_jetstream_the_attach_is_refused(tmp_path: Path) -> None:
    with NatsServer(jetstream=False) as server:
        async for harness in harness_on([NatsBus([server.url]), NatsBus([server.url])], tmp_path):
            await harness.tier()
            reply = await harness.ask(TierAttach(LAYOUT))
            assert isinstance(reply, TierError) and "shoal_kv_" in reply.message
