"""The filesystem tier actor on the in-memory bus and on a real NATS server, driven as the CPU
tier drives it: attach, cascade region slots to files, look up, promote files back into slots.

Round trip of the bytes; a damaged, truncated or foreign file is a miss, removed, and the keys
after it are not returned; the byte budget evicts (files removed) least recently used first; a
new actor on the same root finds and serves the chunks (leftover temp files cleaned); layouts
live apart; a blocked write holds up neither lookups, promotes nor heartbeats, and cascades past
the queue bound are dropped at once; a tier in its own process, SIGKILLed and restarted by the
supervisor, serves the chunks its previous life wrote."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from shoal.bus.base import Bus
from shoal.bus.codec import Codec
from shoal.bus.errors import BusTimeoutError, NoRespondersError
from shoal.bus.messages.control import Heartbeat
from shoal.bus.messages.offload import (
    KVLayout,
    RegionRef,
    SecondaryAttached,
    TierAttach,
    TierAttached,
    TierCascade,
    TierError,
    TierHeld,
    TierJobDone,
    TierLookup,
    TierLookupReply,
    TierPrepareStore,
    TierPromote,
    TierRelease,
    TierReply,
    TierStoreSlots,
)
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import Actor, call
from shoal.bus.runtime.supervisor import ActorSpec, RestartPolicy, Supervisor
from shoal.bus.subjects import Subjects
from shoal.bus.transport.nats_bus import NatsBus
from shoal.config.deployment import FsTierConfig, KVTransferConfig, ShoalConfig
from shoal.deploy.deployment import (
    CPU_TIER_TARGET,
    FS_TIER_TARGET,
    plan_tiers,
    start_in_process,
    stop_in_process,
)
from shoal.tiers.books.keys import make_offload_key
from shoal.tiers.cpu.actor import CpuTierActor
from shoal.tiers.cpu.mapped_regions import MappedRegions
from shoal.tiers.cpu.region import SharedRegion
from shoal.tiers.secondary.fs_actor import FsTierActor
from shoal.tiers.secondary.fs_store import TMP_SUFFIX, ChunkFiles
from tests.fixtures.nats import BusFactory
from tests.integration.conditions import wait_for

LAYOUT = KVLayout("tiny/llama:f16", 2, 4, 2, 8, "float16", 2, 2)  # 2 KiB slots, 2 ranks
OTHER = KVLayout("tiny/qwen:f16", 2, 4, 4, 8, "float16", 1, 2)  # 2 KiB slots too, 1 rank
NUM_SLOTS = 8
REPLY_S = 5.0
QUICK_S = 1.0  # what a request may take while a write is blocked
_REPLY: Codec[TierReply] = Codec(TierReply)


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"))


def keys(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


def pattern(seed: int, size: int) -> bytes:
    return bytes((seed * 13 + i) % 253 for i in range(size))


class Harness:
    """One namespace, a CPU tier's region (a stand-in: the test writes its slots) and the fs
    tier actors of one test, over ``bus``."""

    tier_id = "kv-cpu-fs0"

    def __init__(self, bus: Bus, client: Bus, tmp_path: Path) -> None:
        self.bus, self.client = bus, client
        self.namespace = f"fs{secrets.token_hex(4)}"
        self.root = tmp_path / "kv"
        self.shm = tmp_path / "shm"
        self.shm.mkdir()
        self.actors: list[Actor] = []
        self.regions: list[SharedRegion] = []
        self.region = self.make_region(LAYOUT, "g1")

    def make_region(self, layout: KVLayout, generation: str) -> SharedRegion:
        region = SharedRegion.create(
            self.namespace, f"cpu-{generation}", generation, NUM_SLOTS, layout, self.shm
        )
        self.regions.append(region)
        return region

    async def tier(self, num_chunks: int = 6, **options: Any) -> FsTierActor:
        config = FsTierConfig(path=str(self.root), bytes_to_use=num_chunks * LAYOUT.slot_bytes)
        options.setdefault("heartbeat_interval_s", 0.05)
        options.setdefault("drain_timeout_s", 0.5)
        actor = FsTierActor(
            self.bus, self.tier_id, tier_config=config, namespace=self.namespace, **options
        )
        await actor.start()
        self.actors.append(actor)
        return actor

    async def ask(self, request: Any, timeout: float = REPLY_S) -> Any:
        subject = Subjects(self.namespace).tier_in(self.tier_id)
        return await call(self.client, subject, request, _REPLY, timeout=timeout)

    async def attach(self, layout: KVLayout = LAYOUT) -> SecondaryAttached:
        reply = await self.ask(TierAttach(layout))
        assert isinstance(reply, SecondaryAttached), reply
        return reply

    def fill(self, slot_ids: list[int], seeds: list[int], region: SharedRegion | None = None):
        region = region or self.region
        for slot_id, seed in zip(slot_ids, seeds, strict=True):
            region.slot(slot_id)[:] = pattern(seed, region.ref.layout.slot_bytes)

    def slot(self, slot_id: int, region: SharedRegion | None = None) -> bytes:
        return bytes((region or self.region).slot(slot_id))

    async def cascade(self, ids: list[int], slot_ids: list[int], **kw: Any) -> TierJobDone:
        ref: RegionRef = kw.pop("ref", self.region.ref)
        reply = await self.ask(TierCascade(ref, keys(*ids), slot_ids), **kw)
        assert isinstance(reply, TierJobDone), reply
        return reply

    async def promote(self, ids: list[int], slot_ids: list[int], **kw: Any) -> TierJobDone:
        ref: RegionRef = kw.pop("ref", self.region.ref)
        reply = await self.ask(TierPromote(ref, keys(*ids), slot_ids), **kw)
        assert isinstance(reply, TierJobDone), reply
        return reply

    async def held(self, *ids: int, timeout: float = REPLY_S) -> int:
        reply = await self.ask(TierLookup("engine-0/1", keys(*ids)), timeout=timeout)
        assert isinstance(reply, TierHeld), reply
        return reply.num_leading

    async def close(self) -> None:
        for actor in self.actors:
            await actor.stop()
        for region in self.regions:
            region.close(unlink=True)


@pytest.fixture
async def h(bus_factory: BusFactory, tmp_path: Path) -> AsyncIterator[Harness]:
    harness = Harness(await bus_factory(), await bus_factory(), tmp_path)
    yield harness
    await harness.close()


def done(*ids: int, failed: tuple[int, ...] = ()) -> TierJobDone:
    return TierJobDone(keys(*ids), keys(*failed))


async def test_cascade_then_promote_round_trips_the_bytes(h: Harness) -> None:
    tier = await h.tier()
    assert await h.attach() == SecondaryAttached(0, 0.0)
    index = tier.index
    assert await h.attach() == SecondaryAttached(0, 0.0)
    assert tier.index is index  # the same layout again: no rescan
    h.fill([0, 1, 2], [1, 2, 3])
    assert await h.cascade([1, 2, 3], [0, 1, 2]) == done(1, 2, 3)
    assert await h.cascade([3, 4], [2, 0]) == done(3, 4)  # 3 is held: done, not rewritten
    assert await h.held(1, 2, 3, 9, 4) == 3
    assert await h.attach() == SecondaryAttached(4, 4 / 6)
    for slot_id in range(NUM_SLOTS):
        h.region.slot(slot_id)[:] = bytes(LAYOUT.slot_bytes)

    assert await h.promote([1, 2, 3, 9, 4], [5, 6, 7, 3, 4]) == done(1, 2, 3, failed=(9, 4))
    size = LAYOUT.slot_bytes
    assert [h.slot(s) for s in (5, 6, 7)] == [pattern(i, size) for i in (1, 2, 3)]
    assert h.slot(4) == bytes(size)  # nothing read after the first key not held
    load = tier.load()
    assert (load["num_chunks_stored"], load["num_chunks_loaded"], load["num_chunks_held"]) == (
        4,
        3,
        4,
    )


async def watch_heartbeats(h: Harness) -> list[Heartbeat]:
    beats: list[Heartbeat] = []
    codec: Codec[Heartbeat] = Codec(Heartbeat)

    async def on_beat(msg: Msg) -> None:
        beats.append(codec.decode(msg.data))

    await h.client.subscribe(Subjects(h.namespace).heartbeat("tier"), on_beat)
    await h.client.flush()
    return beats


async def test_heartbeats_carry_the_counters(h: Harness) -> None:
    beats = await watch_heartbeats(h)
    await h.tier()
    await h.attach()
    await h.cascade([1], [0])
    await wait_for(
        lambda: any(b.load.get("num_chunks_stored") == 1.0 for b in beats), REPLY_S, "heartbeat"
    )
    assert {"usage", "num_chunks_corrupt", "num_chunks_dropped"} <= set(beats[-1].load)


def flip_a_byte(files: ChunkFiles, ids: list[int]) -> None:
    path = files.path(key(ids[0]), 1)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x80
    path.write_bytes(raw)


def truncate(files: ChunkFiles, ids: list[int]) -> None:
    path = files.path(key(ids[0]), 0)
    os.truncate(path, path.stat().st_size // 2)


def another_key(files: ChunkFiles, ids: list[int]) -> None:
    for rank in range(LAYOUT.tp_size):  # a copy of the next chunk's files under this one's name
        shutil.copyfile(files.path(key(ids[1]), rank), files.path(key(ids[0]), rank))


@pytest.mark.parametrize("damage", [flip_a_byte, truncate, another_key])
async def test_a_damaged_chunk_is_a_miss_and_removed(
    h: Harness, damage: Callable[[ChunkFiles, list[int]], None]
) -> None:
    tier = await h.tier()
    await h.attach()
    h.fill([0, 1, 2, 3], [1, 2, 3, 4])
    assert await h.cascade([1, 2, 3, 4], [0, 1, 2, 3]) == done(1, 2, 3, 4)
    assert tier.files is not None
    damage(tier.files, [2, 3])

    assert await h.promote([1, 2, 3, 4], [4, 5, 6, 7]) == done(1, failed=(2, 3, 4))
    assert h.slot(4) == pattern(1, LAYOUT.slot_bytes)
    assert not tier.files.path(key(2), 0).exists() and not tier.files.path(key(2), 1).exists()
    assert tier.load()["num_chunks_corrupt"] == 1
    assert await h.held(1, 2, 3) == 1  # dropped from the index
    assert await h.held(4) == 1  # a later, sound chunk is kept
    assert await h.cascade([2], [1]) == done(2)  # and the key can be stored again
    assert await h.promote([1, 2], [4, 5]) == done(1, 2)
    assert h.slot(5) == pattern(2, LAYOUT.slot_bytes)


async def test_the_byte_budget_evicts_the_least_recently_used(h: Harness) -> None:
    tier = await h.tier(num_chunks=2)
    await h.attach()
    h.fill([0, 1, 2], [1, 2, 3])
    assert await h.cascade([1], [0]) == done(1)
    assert await h.cascade([2], [1]) == done(2)
    assert await h.promote([1], [5]) == done(1)  # 1 is now more recent than 2
    assert await h.cascade([3], [2]) == done(3)
    assert tier.files is not None
    assert not tier.files.path(key(2), 0).exists() and not tier.files.path(key(2), 1).exists()
    assert [await h.held(i) for i in (1, 2, 3)] == [1, 0, 1]
    assert tier.load()["num_chunks_evicted"] == 1
    assert await h.cascade([4, 5, 6], [0, 1, 2]) == done(failed=(4, 5, 6))  # more than it holds
    assert [await h.held(i) for i in (1, 3)] == [1, 1]  # and nothing changed


async def test_a_new_actor_on_the_same_root_serves_what_is_there(h: Harness) -> None:
    first = await h.tier()
    await h.attach()
    h.fill([0, 1, 2], [1, 2, 3])
    assert await h.cascade([1, 2, 3], [0, 1, 2]) == done(1, 2, 3)
    assert first.files is not None
    leftover = first.files.path(key(1), 0).with_name(f".leftover.x{TMP_SUFFIX}")
    leftover.write_bytes(b"a write cut short")
    await first.stop()

    # a smaller budget: the least recently used chunk goes, the tail of the prefix as in LRU
    second = await h.tier(num_chunks=2)
    assert await h.attach() == SecondaryAttached(2, 1.0)
    assert not leftover.exists()
    assert await h.held(3) == 0 and await h.held(1, 2) == 2
    assert second.files is not None and not second.files.path(key(3), 0).exists()
    regen = h.make_region(LAYOUT, "g2")  # the CPU tier restarted too: a new region
    assert await h.promote([1, 2], [0, 1], ref=regen.ref) == done(1, 2)
    assert [h.slot(s, regen) for s in (0, 1)] == [pattern(i, LAYOUT.slot_bytes) for i in (1, 2)]


async def test_layouts_live_apart_and_a_new_one_switches(h: Harness, tmp_path: Path) -> None:
    tier = await h.tier()
    await h.attach()
    h.fill([0], [1])
    assert await h.cascade([1], [0]) == done(1)
    other = h.make_region(OTHER, "o1")
    assert await h.cascade([2], [0], ref=other.ref) == done(failed=(2,))  # not attached
    assert await h.attach(OTHER) == SecondaryAttached(0, 0.0)
    h.fill([0], [7], other)
    assert await h.cascade([1], [0], ref=other.ref) == done(1)  # the same key, its own file
    assert await h.cascade([3], [1]) == done(failed=(3,))  # the old layout's region: refused
    assert await h.promote([1], [1]) == done(failed=(1,))
    assert await h.attach() == SecondaryAttached(1, 1 / 6)  # back: its files are found again
    assert await h.promote([1], [3]) == done(1)
    assert h.slot(3) == pattern(1, LAYOUT.slot_bytes)
    assert tier.files is not None
    dirs = sorted(str(p.parent.parent.relative_to(h.root)) for p in h.root.rglob("*.bin"))
    assert len(set(dirs)) == 3  # two ranks of LAYOUT, one of OTHER, two model directories
    assert len({d.split("/")[0] for d in dirs}) == 2


async def test_bad_requests_get_clear_answers(h: Harness) -> None:
    await h.tier()
    for request in (  # nothing attached yet (a restarted tier): the CPU tier attaches again
        TierLookup("engine-0/1", keys(1)),
        TierPromote(h.region.ref, keys(1), [0]),
        TierCascade(h.region.ref, keys(1), [0]),
    ):
        reply = await h.ask(request)
        assert isinstance(reply, TierError) and "not attached" in reply.message, reply
    huge = KVLayout("huge", 64, 16, 8, 128, "float16", 1, 1)
    reply = await h.ask(TierAttach(huge))
    assert isinstance(reply, TierError) and "bytes_to_use" in reply.message
    await h.attach()
    reply = await h.ask(TierCascade(h.region.ref, keys(1, 2), [0]))
    assert isinstance(reply, TierError)
    gone = RegionRef(str(h.shm / "gone.kv"), "x", NUM_SLOTS, LAYOUT)
    assert await h.cascade([1], [0], ref=gone) == done(failed=(1,))
    assert await h.held(1) == 0


class BlockedWrites:
    """Writes that wait (bounded) until released; ``entered`` counts the writes started."""

    def __init__(self, tier: FsTierActor) -> None:
        assert tier.files is not None
        self.release = threading.Event()
        self.entered = 0
        real = tier.files.write_chunk

        def write_chunk(
            key: bytes, slot: memoryview, stamp_ns: int | None = None, deadline: float = 0.0
        ) -> None:
            self.entered += 1
            self.release.wait(REPLY_S)
            real(key, slot, stamp_ns, deadline)

        tier.files.write_chunk = write_chunk  # type: ignore[method-assign]


async def test_a_blocked_write_holds_up_no_lookup_or_promote(h: Harness) -> None:
    beats = await watch_heartbeats(h)
    tier = await h.tier(max_queued_cascades=2, num_io_threads=1)
    await h.attach()
    h.fill([0, 1, 2, 3], [1, 2, 3, 4])
    assert await h.cascade([1], [0]) == done(1)
    blocked = BlockedWrites(tier)
    first = asyncio.create_task(h.cascade([2], [1]))
    await wait_for(lambda: blocked.entered == 1, REPLY_S, "the first write started")
    second = asyncio.create_task(h.cascade([3], [2]))
    await wait_for(lambda: tier.num_cascades_queued == 2, REPLY_S, "the second cascade queued")
    num_beats = len(beats)

    assert await h.held(1, 2, 3, timeout=QUICK_S) == 1  # 2 is being written: not held yet
    assert await h.promote([1], [5], timeout=QUICK_S) == done(1)
    assert await h.cascade([4], [3], timeout=QUICK_S) == done(failed=(4,))  # past the bound
    assert tier.load()["num_chunks_dropped"] == 1
    await wait_for(lambda: len(beats) > num_beats + 1, REPLY_S, "heartbeats go on")
    assert not first.done() and not second.done()

    blocked.release.set()
    assert await first == done(2) and await second == done(3)
    assert await h.held(1, 2, 3) == 3


def chunk_files(h: Harness) -> list[Path]:
    return [p for p in h.root.rglob("*") if p.is_file()]


async def test_past_its_deadline_a_job_fails_and_touches_no_slot(h: Harness) -> None:
    """The CPU tier may reuse the slots after the deadline: nothing is read from or written to
    them then; a deadline of 0.0 is none."""
    tier = await h.tier(num_chunks=1)
    await h.attach()
    h.fill([0, 1, 2], [1, 2, 3])
    past = time.time() - 1.0
    cascade = await h.ask(TierCascade(h.region.ref, keys(1, 2), [0, 1], past))
    assert cascade == done(failed=(1, 2)) and chunk_files(h) == []
    assert await h.held(1, 2) == 0
    assert await h.cascade([3], [2]) == done(3)
    late = await h.ask(TierCascade(h.region.ref, keys(4), [0], past))
    assert late == done(failed=(4,)) and await h.held(3) == 1  # 3 not evicted for it
    h.region.slot(5)[:] = bytes(LAYOUT.slot_bytes)
    promote = await h.ask(TierPromote(h.region.ref, keys(3), [5], past))
    assert promote == done(failed=(3,)) and h.slot(5) == bytes(LAYOUT.slot_bytes)
    assert await h.held(3) == 1  # kept: it was not read, not found wrong
    soon = time.time() + REPLY_S
    assert await h.ask(TierPromote(h.region.ref, keys(3), [5], soon)) == done(3)
    assert h.slot(5) == pattern(3, LAYOUT.slot_bytes)
    assert tier.load()["num_chunks_late"] == 4.0


async def test_a_deadline_passing_during_a_cascade_publishes_nothing(h: Harness) -> None:
    """A slot read past the deadline may hold another chunk by then: no file is published from
    it, and the keys left fail at once."""
    tier = await h.tier(num_io_threads=1)
    await h.attach()
    h.fill([0, 1], [1, 2])
    assert tier.files is not None
    real, release, entered = tier.files._write_temp, threading.Event(), []

    def slow_read(*args: Any) -> Path:
        path = real(*args)
        entered.append(path)
        release.wait(REPLY_S)
        return path

    tier.files._write_temp = slow_read  # type: ignore[method-assign]
    deadline = time.time() + 0.5
    job = asyncio.create_task(h.ask(TierCascade(h.region.ref, keys(1, 2), [0, 1], deadline)))
    await wait_for(lambda: entered, REPLY_S, "the first slot read")
    await wait_for(lambda: time.time() > deadline, REPLY_S, "the deadline passed")
    release.set()
    assert await job == done(failed=(1, 2))
    assert chunk_files(h) == [] and await h.held(1, 2) == 0
    assert tier.load()["num_chunks_late"] == 2.0


def test_old_region_generations_are_unmapped_once_unused(tmp_path: Path) -> None:
    regions = [SharedRegion.create("ns", f"t{g}", f"g{g}", 1, OTHER, tmp_path) for g in range(3)]
    mapped = MappedRegions(keep=1)
    with mapped.use(regions[0].ref) as r0:
        with mapped.use(regions[1].ref):
            assert mapped.num_mapped == 2  # the older one is in use: still mapped
        slot = r0.slot(0)
        slot[:4] = b"abcd"
        del slot
    assert mapped.num_mapped == 1
    with mapped.use(regions[2].ref), mapped.use(regions[2].ref):
        pass
    assert mapped.num_mapped == 1
    mapped.close()
    assert mapped.num_mapped == 0
    assert bytes(regions[0].slot(0)[:4]) == b"abcd"
    for region in regions:
        region.close(unlink=True)


async def attach_until_answered(bus: Bus, subject: str, limit_s: float) -> SecondaryAttached:
    """Attach until the tier answers (its process may still be starting); bounded."""
    async with asyncio.timeout(limit_s):
        while True:
            try:
                reply = await call(bus, subject, TierAttach(LAYOUT), _REPLY, timeout=QUICK_S)
            except (NoRespondersError, BusTimeoutError):
                await asyncio.sleep(0.05)
                continue
            assert isinstance(reply, SecondaryAttached), reply
            return reply


@pytest.mark.nats
async def test_a_killed_tier_process_comes_back_with_its_files(nats_url: str, tmp_path: Path):
    client = NatsBus([nats_url])
    await client.connect()
    h = Harness(client, client, tmp_path)
    config = FsTierConfig(path=str(h.root), bytes_to_use=6 * LAYOUT.slot_bytes)
    spec = ActorSpec(
        name="fs",
        target="shoal.tiers.secondary.fs_actor:FsTierActor",
        bus_url=nats_url,
        kwargs={"actor_id": "kv-cpu-fs0", "tier_config": config, "namespace": h.namespace},
        kind="tier",
    )
    subject = Subjects(h.namespace).tier_in("kv-cpu-fs0")
    policy = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, max_restarts=2)
    try:
        async with Supervisor([spec], policy=policy, grace_s=3) as supervisor:
            assert await attach_until_answered(client, subject, 30.0) == SecondaryAttached(0)
            h.fill([0, 1, 2], [1, 2, 3])
            assert await h.cascade([1, 2, 3], [0, 1, 2]) == done(1, 2, 3)  # its own mapping
            pid = supervisor.pid("fs")
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await wait_for(lambda: supervisor.pid("fs") not in (None, pid), 30.0, "restarted")

            assert await attach_until_answered(client, subject, 30.0) == SecondaryAttached(3, 0.5)
            for slot_id in range(3):
                h.region.slot(slot_id)[:] = bytes(LAYOUT.slot_bytes)
            assert await h.promote([1, 2, 3], [5, 6, 7]) == done(1, 2, 3)
            assert [h.slot(s) for s in (5, 6, 7)] == [
                pattern(i, LAYOUT.slot_bytes) for i in (1, 2, 3)
            ]
    finally:
        await h.close()
        await client.close()


async def test_behind_the_cpu_tier_as_the_deployment_plans_them(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """The real CPU tier in front: its stores cascade to files, and a restarted (empty) CPU
    tier promotes them back into its new region when an engine core looks them up."""
    layout = KVLayout("tiny/llama:f16", 2, 4, 2, 8, "float16", 2, 1)  # one block per chunk
    namespace = f"fsp{secrets.token_hex(4)}"
    extra = {
        "cpu_bytes_to_use": 4 * layout.slot_bytes,
        "secondary_tiers": [{"type": "fs", "path": str(tmp_path), "bytes_to_use": 1 << 20}],
    }
    kv_json = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}
    config = ShoalConfig.from_options(
        model="unused", namespace=namespace, kv_transfer_config=kv_json
    )
    plans = plan_tiers(config)
    assert [p.target for p in plans] == [FS_TIER_TARGET, CPU_TIER_TARGET]
    bus = await bus_factory()
    actors = await start_in_process(bus, plans)
    fs, cpu = actors
    subject = Subjects(namespace).tier_in(config.kv_transfer_config.cpu_tier_id)

    async def ask(request: Any) -> Any:
        return await call(bus, subject, request, _REPLY, timeout=REPLY_S)

    try:
        attached = await ask(TierAttach(layout))
        assert isinstance(attached, TierAttached)
        slots = await ask(TierPrepareStore("engine-0/1", keys(1, 2)))
        assert isinstance(slots, TierStoreSlots) and slots.keys == keys(1, 2)
        region = SharedRegion.attach(attached.region)  # as a worker copies its blocks in
        for seed, slot_id in zip((1, 2), slots.slot_ids, strict=True):
            region.slot(slot_id)[:] = pattern(seed, layout.slot_bytes)
        region.close()
        await ask(TierRelease("engine-0/1", stored_keys=keys(1, 2)))
        await wait_for(lambda: fs.load()["num_chunks_stored"] == 2, REPLY_S, "cascaded")
        assert len(list(tmp_path.rglob("*.bin"))) == 2 * layout.tp_size

        await stop_in_process([cpu])
        actors[1:] = await start_in_process(bus, plans[1:])  # a new, empty CPU tier
        fresh = await ask(TierAttach(layout))
        assert isinstance(fresh, TierAttached)
        assert fresh.region.generation != attached.region.generation
        hit = await ask(TierLookup("engine-0/1", keys(1, 2, 3)))
        assert isinstance(hit, TierLookupReply) and len(hit.slot_ids) == 2, hit
        region = SharedRegion.attach(fresh.region)
        read = [bytes(region.slot(s)) for s in hit.slot_ids]
        region.close()
        assert read == [pattern(i, layout.slot_bytes) for i in (1, 2)]
        assert fs.load()["num_chunks_loaded"] == 2
    finally:
        await stop_in_process(actors)


async def test_a_restarted_fs_tier_is_attached_again_by_its_cpu_tier(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """The fs tier process restarts: the CPU tier's next job finds it unattached, detaches the
    link, attaches it again (its files found) and cascades and promotes through it again."""
    layout = KVLayout("tiny/llama:f16", 2, 4, 2, 8, "float16", 1, 1)
    fs_config = FsTierConfig(path=str(tmp_path / "kv"), bytes_to_use=1 << 20)
    kv = KVTransferConfig(
        kv_connector="OffloadingConnector",
        cpu_bytes_to_use=8 * layout.slot_bytes,
        secondary_tiers=(fs_config,),
    )
    namespace = f"fsr{secrets.token_hex(4)}"
    bus = await bus_factory()
    fs_id = kv.secondary_tier_ids[0]

    def new_fs() -> FsTierActor:
        return FsTierActor(bus, fs_id, tier_config=fs_config, namespace=namespace)

    cpu = CpuTierActor(
        bus, kv_config=kv, namespace=namespace, region_directory=tmp_path,
        sweep_interval_s=0.1, secondary_retry_s=0.1, drain_timeout_s=0.5,
    )  # fmt: skip
    fs = new_fs()
    actors: list[Actor] = [fs, cpu]
    for actor in actors:
        await actor.start()
    subject = Subjects(namespace).tier_in(kv.cpu_tier_id)

    async def ask(request: Any) -> Any:
        return await call(bus, subject, request, _REPLY, timeout=REPLY_S)

    async def store(*ids: int) -> None:
        slots = await ask(TierPrepareStore("engine-0/1", keys(*ids)))
        assert isinstance(slots, TierStoreSlots)
        region = SharedRegion.attach(attached.region)
        for seed, slot_id in zip(ids, slots.slot_ids, strict=True):
            region.slot(slot_id)[:] = pattern(seed, layout.slot_bytes)
        region.close()
        await ask(TierRelease("engine-0/1", stored_keys=slots.keys))

    try:
        attached = await ask(TierAttach(layout))
        assert isinstance(attached, TierAttached)
        await store(1)
        await wait_for(lambda: fs.load()["num_chunks_stored"] == 1, REPLY_S, "cascaded")
        await fs.stop()
        actors[0] = fs = new_fs()
        await fs.start()
        await store(2)  # its cascade is refused: the link detaches, and is attached again
        link = cpu.links[0]
        await wait_for(lambda: link.is_attached and fs.store is not None, REPLY_S, "attached")
        await store(3)
        await wait_for(lambda: fs.load()["num_chunks_stored"] == 1, REPLY_S, "cascaded again")
        assert fs.load()["num_chunks_held"] == 2  # chunk 1 found on disk, chunk 3 written
    finally:
        await stop_in_process(actors)
