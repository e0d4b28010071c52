"""Object-store tier actors of two hosts on one bucket (one namespace, one nats-server), driven
as their CPU tiers drive them.

A chunk host A puts after host B attached is found by B's lookup (the store is asked for the
keys past B's index; an incomplete chunk is not) and promoted; each tier's budget deletes only
the objects it wrote and only forgets the other host's, at attach and later, and an adoption's
delete spares a chunk stored again while it waited; a lookup whose probe of the store hangs or
fails is answered from the index in time; a put cut short by a cancellation or a timeout leaves
neither its object nor its chunk messages in the stream, and a replaced object's old chunks are
purged (the objects stay readable by nats-py); an object whose chunk messages are gone is a miss
at once (not a read timeout), and removed."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from shoal.bus.errors import BusTimeoutError
from shoal.bus.jetstream.object_store import NatsObjectStore
from shoal.bus.messages.offload import SecondaryAttached, TierPromote
from shoal.bus.transport.nats_bus import NatsBus
from shoal.tiers.secondary import obj_store
from shoal.tiers.secondary.obj_actor import ObjTierActor
from shoal.tiers.secondary.obj_store import ObjectChunks
from tests.actors.test_fs_tier_actor import LAYOUT, OTHER, REPLY_S, done, key, pattern
from tests.actors.test_obj_tier_actor import ObjHarness, chunks_of, object_names
from tests.actors.test_object_store import at_direct_get
from tests.integration.conditions import wait_for

SIZE = LAYOUT.slot_bytes


class Host(ObjHarness):
    """One host's side: its CPU tier's region and its object tier ``<host>-cpu-obj0``, in the
    namespace (and so the bucket) the hosts share."""

    def __init__(self, bus: NatsBus, client: NatsBus, tmp_path: Path, name: str, ns: str) -> None:
        (tmp_path / name).mkdir()
        super().__init__(bus, client, tmp_path / name)
        self.namespace = ns
        self.tier_id = f"{name}-cpu-obj0"

    async def tier(self, num_chunks: int = 6, **options: Any) -> ObjTierActor:
        tier = await super().tier(num_chunks, **options)
        await self.attach()
        return tier


@pytest.fixture
async def hosts(nats_url: str, tmp_path: Path) -> AsyncIterator[tuple[Host, Host]]:
    buses = [NatsBus([nats_url]), NatsBus([nats_url])]
    for bus in buses:
        await bus.connect()
    namespace = f"objh{secrets.token_hex(4)}"
    a, b = (Host(buses[0], buses[1], tmp_path, name, namespace) for name in ("ha", "hb"))
    yield a, b
    for host in (a, b):
        await host.close()
    for bus in buses:
        await bus.close()


async def chunk_subjects(host: Host) -> dict[str, int]:
    """The bucket stream's chunk subjects that hold messages, with their counts."""
    assert isinstance(host.client, NatsBus)
    bucket = f"shoal_kv_{host.namespace}"
    js = host.client.client.jetstream()
    info = await js.stream_info(f"OBJ_{bucket}", subjects_filter=f"$O.{bucket}.C.>")
    return dict(info.state.subjects or {})


async def test_a_chunk_put_by_another_host_after_attach_is_found(
    hosts: tuple[Host, Host],
) -> None:
    a, b = hosts
    tier_a, tier_b = await a.tier(), await b.tier()  # both attached to an empty bucket
    a.fill([0, 1, 2], [1, 2, 3])
    assert await a.cascade([1, 2, 3], [0, 1, 2]) == done(1, 2, 3)
    await chunks_of(tier_a).store.delete(chunks_of(tier_a).name(key(3), 1))  # 3 is incomplete

    assert await b.held(1, 2, 3) == 2
    assert await b.held(1, 2) == 2  # now from B's index
    assert await b.promote([1, 2], [4, 5]) == done(1, 2)
    assert [b.slot(4), b.slot(5)] == [pattern(1, SIZE), pattern(2, SIZE)]
    assert tier_b.load()["num_chunks_adopted"] == 2
    assert tier_b.load()["num_chunks_loaded"] == 2


async def test_a_tier_deletes_only_what_it_wrote(hosts: tuple[Host, Host]) -> None:
    """B's budget holds two chunks: A's chunks leave B's index without being deleted, and B's
    own chunk is deleted once it is B's least recently used."""
    a, b = hosts
    tier_a, tier_b = await a.tier(), await b.tier(num_chunks=2)
    a.fill([0, 1, 2], [1, 2, 3])
    assert await a.cascade([1, 2, 3], [0, 1, 2]) == done(1, 2, 3)
    assert await b.held(1, 2, 3) == 2  # as many as B's budget holds: 1, 2 adopted (2 older)
    b.fill([0], [7])
    assert await b.cascade([7], [0]) == done(7)  # B's own: 2 forgotten
    assert await b.held(3) == 1  # adopted: 1 forgotten (B's index: 7, 3)
    assert await b.held(1) == 1  # adopted again: 7, B's own and least recent, is deleted
    await wait_for(lambda: tier_b.load()["num_chunks_evicted"] == 1, REPLY_S, "B's delete ran")
    assert await a.names() == object_names(tier_a, 1, 2, 3)
    load = tier_b.load()
    assert (load["num_chunks_forgotten"], load["num_chunks_adopted"]) == (2, 4)


async def test_at_attach_another_hosts_objects_are_not_deleted(hosts: tuple[Host, Host]) -> None:
    a, b = hosts
    tier_a = await a.tier()
    a.fill([0, 1, 2], [1, 2, 3])
    assert await a.cascade([1, 2, 3], [0, 1, 2]) == done(1, 2, 3)
    tier_b = await b.tier(num_chunks=1)  # the bucket holds three times B's budget
    assert await b.attach() == SecondaryAttached(1, 1.0)
    assert await b.held(3) == 1 and await b.held(1) == 1  # 1 found by asking the store
    assert await a.names() == object_names(tier_a, 1, 2, 3)
    assert tier_b.load()["num_chunks_evicted"] == 0


async def test_a_hung_probe_is_answered_from_the_index_in_time(hosts: tuple[Host, Host]) -> None:
    a, b = hosts
    await a.tier()
    tier_b = await b.tier(probe_timeout_s=0.2)
    a.fill([0, 1], [1, 2])
    assert await a.cascade([1], [0]) == done(1)
    b.fill([1], [2])
    assert await b.cascade([2], [1]) == done(2)
    hang = asyncio.Event()

    async def hung_probe(keys: list[bytes]) -> list[Any]:
        await asyncio.wait_for(hang.wait(), REPLY_S)  # never set: the tier's bound must act
        return []

    chunks_of(tier_b).probe = hung_probe  # type: ignore[method-assign]
    assert await b.held(2, 1, timeout=1.0) == 1
    assert await b.held(1, timeout=1.0) == 0
    assert tier_b.load()["num_probe_failures"] == 2


async def hold_publishes(store: NatsObjectStore, after: int) -> asyncio.Event:
    """Let ``after`` publishes of ``store`` through, then hold the next one (bounded); the
    event is set once it is held."""
    js: Any = store._js
    real, held = js.publish, asyncio.Event()
    count = 0

    async def publish(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        if count == after + 1:  # this one only: the cleanup's publishes go through
            held.set()
            await asyncio.wait_for(asyncio.Event().wait(), REPLY_S)
        return await real(*args, **kwargs)

    js.publish = publish
    return held


async def test_a_cancelled_put_leaves_no_chunk_messages(hosts: tuple[Host, Host]) -> None:
    a, _ = hosts
    assert isinstance(a.client, NatsBus)
    store = await NatsObjectStore.open(a.client, f"shoal_kv_{a.namespace}")
    await store.put("kept", b"k" * 1000)
    before = await chunk_subjects(a)
    held = await hold_publishes(store, after=3)  # three chunks of the four in the stream
    put = asyncio.create_task(store.put("cut", bytes(4 * 128 * 1024)))
    await asyncio.wait_for(held.wait(), REPLY_S)
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    await wait_for(lambda: store.num_orphans == 0, REPLY_S, "the cut put's chunks purged")
    assert await chunk_subjects(a) == before
    assert await store.info("cut") is None and await store.info("kept") is not None


async def test_a_timed_out_chunk_write_leaves_nothing(hosts: tuple[Host, Host]) -> None:
    a, _ = hosts
    tier = await a.tier(io_timeout_s=0.5)
    a.fill([0], [1])
    held = await hold_publishes(chunks_of(tier).store, after=3)  # part 1's meta is held
    assert await a.cascade([1], [0]) == done(failed=(1,))
    assert held.is_set()
    await wait_for(lambda: chunks_of(tier).store.num_orphans == 0, REPLY_S, "purged")
    assert await chunk_subjects(a) == {} and await a.names() == set()
    assert await a.held(1) == 0


async def test_an_object_whose_chunks_are_gone_is_a_miss_at_once(
    hosts: tuple[Host, Host],
) -> None:
    a, _ = hosts
    tier = await a.tier(io_timeout_s=REPLY_S)
    a.fill([0, 1], [1, 2])
    assert await a.cascade([1, 2], [0, 1]) == done(1, 2)
    assert isinstance(a.client, NatsBus)
    js, bucket = a.client.client.jetstream(), f"shoal_kv_{a.namespace}"
    objects = await js.object_store(bucket)
    nuid = (await objects.get_info(chunks_of(tier).name(key(2), 1))).nuid
    await js.purge_stream(f"OBJ_{bucket}", subject=f"$O.{bucket}.C.{nuid}")  # part 1's chunks

    assert await a.promote([1, 2], [4, 5], timeout=1.0) == done(1, failed=(2,))
    assert await a.names() == object_names(tier, 1)
    assert tier.load()["num_chunks_corrupt"] == 1


async def test_a_store_that_cannot_answer_a_probe_costs_a_miss(hosts: tuple[Host, Host]) -> None:
    """The store's own error in a probe (not a timeout) is the tier's: the lookup is answered
    from the index."""
    a, _ = hosts
    tier = await a.tier()
    a.fill([0], [1])
    assert await a.cascade([1], [0]) == done(1)

    async def broken_info(name: str) -> Any:
        raise OSError("connection reset")

    chunks_of(tier).store.info = broken_info  # type: ignore[method-assign]
    assert await a.held(1, 2) == 1
    assert tier.load()["num_probe_failures"] == 1


async def test_a_replaced_object_leaves_only_its_new_chunks(hosts: tuple[Host, Host]) -> None:
    """shoal's put in nats-py's format: nats-py's own client reads the object (and who wrote
    it); putting the name again purges the old chunks."""
    a, _ = hosts
    assert isinstance(a.client, NatsBus)
    bucket = f"shoal_kv_{a.namespace}"
    store = await NatsObjectStore.open(a.client, bucket)
    await store.put("x", b"1" * (200 * 1024), writer="ha-cpu-obj0")
    first = await chunk_subjects(a)
    assert [e.writer for e in await store.list()] == ["ha-cpu-obj0"]
    await store.put("x", b"2" * (300 * 1024))
    await wait_for(lambda: store.num_orphans == 0, REPLY_S, "the old chunks purged")
    now = await chunk_subjects(a)
    assert len(first) == len(now) == 1 and first != now and list(now.values()) == [3]
    theirs = await a.client.client.jetstream().object_store(bucket)
    assert (await theirs.get("x")).data == b"2" * (300 * 1024)
    entry = await store.info("x")
    assert entry is not None and entry.writer == "" and entry.size == 300 * 1024


async def test_an_adoptions_delete_spares_a_chunk_stored_again_meanwhile(
    hosts: tuple[Host, Host],
) -> None:
    """An adoption evicts B's own chunk 7 while a cascade that stores 7 again waits for the
    write lock: the delete runs behind it and leaves the live object alone."""
    a, b = hosts
    await a.tier()
    tier = await b.tier(num_chunks=2)
    b.fill([0, 1, 2], [6, 7, 8])
    assert await b.cascade([6], [0]) == done(6)
    assert await b.cascade([7], [1]) == done(7)
    chunks, release, entered = chunks_of(tier), asyncio.Event(), asyncio.Event()
    real = chunks.write_chunk

    async def held_write(key: bytes, slot: memoryview, deadline: float = 0.0) -> None:
        entered.set()
        await asyncio.wait_for(release.wait(), REPLY_S)
        await real(key, slot, deadline)

    chunks.write_chunk = held_write  # type: ignore[method-assign]
    first = asyncio.create_task(b.cascade([8], [2]))  # 6 evicted; 8's write holds the lock
    await asyncio.wait_for(entered.wait(), REPLY_S)
    again = asyncio.create_task(b.cascade([7], [1]))  # waits for the lock
    await wait_for(lambda: tier.num_cascades_queued == 2, REPLY_S, "the second cascade queued")
    a.fill([3], [1])
    assert await a.cascade([1], [3]) == done(1)
    assert await b.held(1) == 1  # adopted: 7 evicted, its delete queued behind the cascades
    release.set()
    assert await first == done(8) and await again == done(7)
    await wait_for(lambda: not tier._evictions, REPLY_S, "the adoption's delete ran")
    assert await b.held(7) == 1
    assert object_names(tier, 7) <= await b.names()
    assert await b.promote([7], [4]) == done(7) and b.slot(4) == pattern(7, SIZE)


async def test_a_chunk_its_writer_deletes_while_another_host_reads_it_is_a_miss_at_once(
    hosts: tuple[Host, Host],
) -> None:
    """A's budget deletes its chunk while B, which adopted it, reads it (its meta read, no
    chunk yet): B's promote fails that key at once (not at the read's timeout) and B
    forgets it."""
    a, b = hosts
    tier_a, tier_b = await a.tier(), await b.tier(io_timeout_s=30.0)
    a.fill([0], [1])
    assert await a.cascade([1], [0]) == done(1)
    assert await b.held(1) == 1  # adopted

    async def delete() -> None:
        assert await chunks_of(tier_a).delete(key(1))

    at_direct_get(chunks_of(tier_b).store, delete, after=False)
    assert await b.promote([1], [4], timeout=2.0) == done(failed=(1,))
    assert await b.held(1) == 0 and tier_b.load()["num_chunks_corrupt"] == 1


async def test_a_read_that_hangs_ends_at_its_jobs_deadline(hosts: tuple[Host, Host]) -> None:
    """A read is given what is left before the job's deadline, not the whole I/O timeout: the
    promote answers in time, the key late, the slot untouched."""
    a, _ = hosts
    tier = await a.tier(io_timeout_s=30.0)
    a.fill([0], [1])
    assert await a.cascade([1], [0]) == done(1)

    async def hung_get(name: str, *, timeout: float = 10.0) -> bytes | None:
        try:  # a read that waits as long as it is allowed to
            await asyncio.wait_for(asyncio.Event().wait(), timeout)
        except TimeoutError:
            raise BusTimeoutError(f"{name}: nothing within {timeout}s") from None
        return None

    chunks_of(tier).store.get = hung_get  # type: ignore[method-assign]
    a.region.slot(4)[:] = bytes(SIZE)
    promote = TierPromote(a.region.ref, [key(1)], [4], deadline=time.time() + 0.3)
    assert await a.ask(promote, timeout=2.0) == done(failed=(1,))
    assert a.slot(4) == bytes(SIZE)
    assert tier.load()["num_chunks_late"] == 1 and await a.held(1) == 1


async def test_a_part_put_again_while_read_is_a_miss_left_in_place(
    hosts: tuple[Host, Host],
) -> None:
    """Another host puts a part of B's chunk again (the same bytes) while B reads it: B's
    read is a miss, nothing is deleted, and the next promote reads the new object."""
    a, b = hosts
    tier = await b.tier()
    b.fill([0], [1])
    assert await b.cascade([1], [0]) == done(1)
    assert isinstance(a.client, NatsBus)
    other = await NatsObjectStore.open(a.client, f"shoal_kv_{a.namespace}")
    name = chunks_of(tier).name(key(1), 0)  # read first
    part = await other.get(name)
    assert part is not None

    async def put_again() -> None:
        assert await other.put(name, bytes(part), writer="ha-cpu-obj0")
        await wait_for(lambda: other.num_orphans == 0, REPLY_S, "the old chunks purged")

    at_direct_get(chunks_of(tier).store, put_again, after=False)
    assert await b.promote([1], [4]) == done(failed=(1,))
    assert await b.names() == object_names(tier, 1) and await b.held(1) == 1
    assert tier.load()["num_chunks_corrupt"] == 0
    assert await b.promote([1], [4]) == done(1) and b.slot(4) == pattern(1, SIZE)
    await other.close()


async def test_an_adoptions_delete_queued_over_a_layout_switch_spares_others_chunks(
    hosts: tuple[Host, Host],
) -> None:
    """B adopts A's chunks while its cascades hold the write lock, so the eviction of the least
    recent waits; B then switches layout (its foreign set is the new layout's): A's chunk is
    only forgotten, never deleted."""
    a, b = hosts
    tier_a, tier_b = await a.tier(), await b.tier(num_chunks=2)
    a.fill([0, 1, 2], [1, 2, 3])
    assert await a.cascade([1, 2, 3], [0, 1, 2]) == done(1, 2, 3)
    assert await b.held(1, 2) == 2  # adopted, both A's
    await tier_b._write_lock.acquire()  # a cascade running
    try:
        assert await b.held(3) == 1  # adopted: one of A's leaves B's index
        assert await b.attach(OTHER) == SecondaryAttached(0, 0.0)
    finally:
        tier_b._write_lock.release()
    await wait_for(lambda: not tier_b._evictions, REPLY_S, "the queued eviction ran")
    assert await a.names() == object_names(tier_a, 1, 2, 3)
    assert (tier_b.load()["num_chunks_forgotten"], tier_b.load()["num_chunks_evicted"]) == (1, 0)


async def test_a_scan_spares_another_hosts_chunk_while_it_is_written(
    hosts: tuple[Host, Host], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An incomplete chunk (one part of two put) is another host's write in progress: a scan
    removes it only once it is stale; its own incomplete chunks it removes at once."""
    a, b = hosts
    assert isinstance(a.client, NatsBus)
    store = await NatsObjectStore.open(a.client, f"shoal_kv_{a.namespace}")
    names = ObjectChunks(store, LAYOUT)
    await store.put(names.name(key(5), 0), b"A's part 0", writer="ha-cpu-obj0")
    await store.put(names.name(key(6), 0), b"B's part 0", writer="hb-cpu-obj0")
    await (await b.tier()).stop()  # its attach scans the bucket
    assert await b.names() == {names.name(key(5), 0)}
    monkeypatch.setattr(obj_store, "STALE_PART_S", 0.0)
    await b.tier()  # B restarted: A's part is stale now
    assert await b.names() == set()
    await store.close()
