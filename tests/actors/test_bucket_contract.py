"""The key-value bucket and object store contract (``bus.buckets``): every test runs on the
in-memory bus and on a real nats-server (``bus_factory``), with the same body. Two buses of
one test share the buckets (one broker, one server)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from shoal.bus.base import Bus
from shoal.bus.buckets import KvBucket, KvEntry, ObjectStore, ValueTooLargeError
from shoal.bus.errors import BusTimeoutError, PayloadIntegrityError
from shoal.bus.jetstream import object_store
from shoal.bus.transport import memory_jetstream
from shoal.bus.transport.memory_jetstream import MemoryObjectStore

BusFactory = Callable[..., Awaitable[Bus]]
WAIT_S = 10.0


def bucket_name() -> str:
    return f"t_{uuid.uuid4().hex[:10]}"  # the session's server keeps every test's buckets


async def watched(bucket: KvBucket, keys: str, count: int, then: Any = None) -> list[KvEntry]:
    """The first ``count`` entries of a watch of ``keys``; ``then()`` runs after the first."""
    seen: list[KvEntry] = []
    async with asyncio.timeout(WAIT_S):
        watch = bucket.watch(keys)
        async for entry in watch:
            seen.append(entry)
            if len(seen) == 1 and then is not None:
                await then()
            if len(seen) == count:
                break
        await watch.aclose()
    return seen


async def gone(bucket: KvBucket, key: str) -> bool:
    """Whether ``key`` expires within a few seconds (polled, bounded)."""
    for _ in range(100):
        if await bucket.get(key) is None:
            return True
        await asyncio.sleep(0.05)  # paces the polling
    return False


# ---- key-value buckets ----------------------------------------------------------------------


async def test_kv_put_get_delete_and_history(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    bucket = await bus.open_kv(bucket_name(), history=3)
    first = await bucket.put("engine.e0", b"a")
    second = await bucket.put("engine.e0", b"b")
    assert first < second and await bucket.get("engine.e0") == b"b"
    assert await bucket.get("engine.missing") is None
    await bucket.delete("engine.e0")
    assert await bucket.get("engine.e0") is None
    await bucket.put("engine.e0", b"c")
    history = await bucket.history("engine.e0")
    assert [e.value for e in history] == [b"b", None, b"c"]  # three kept: "a" is gone
    assert await bucket.history("engine.missing") == []
    with pytest.raises(ValueError):
        await bucket.put("not a key", b"x")


async def test_kv_buses_share_a_bucket_that_keeps_its_settings(bus_factory: BusFactory) -> None:
    a, b = await bus_factory(), await bus_factory()
    name = bucket_name()
    await (await a.open_kv(name, history=1)).put("k", b"1")
    other = await b.open_kv(name, history=5)  # exists: its own history (1) holds
    assert await other.get("k") == b"1"
    await other.put("k", b"2")
    assert [e.value for e in await other.history("k")] == [b"2"]


async def test_kv_watch_yields_latest_values_then_changes(bus_factory: BusFactory) -> None:
    a, b = await bus_factory(), await bus_factory()
    name = bucket_name()
    bucket, theirs = await a.open_kv(name), await b.open_kv(name)
    await bucket.put("engine.e0", b"ready")
    await bucket.put("engine.e9", b"old")
    await bucket.delete("engine.e9")  # a delete marker is the key's latest revision
    await bucket.put("other.x", b"not watched")

    async def change() -> None:
        await theirs.put("engine.e1", b"starting")  # from the other bus
        await theirs.put("other.y", b"not watched")
        await theirs.delete("engine.e0")

    seen = await watched(bucket, "engine.>", 4, then=change)
    assert [(e.key, e.value) for e in seen] == [
        ("engine.e0", b"ready"),
        ("engine.e9", None),
        ("engine.e1", b"starting"),
        ("engine.e0", None),
    ]
    assert [e.revision for e in seen[1:]] == sorted(e.revision for e in seen[1:])
    assert seen[0].revision < seen[1].revision


async def test_kv_watch_times_out_without_a_change(bus_factory: BusFactory) -> None:
    bucket = await (await bus_factory()).open_kv(bucket_name())
    with pytest.raises(BusTimeoutError):
        async with asyncio.timeout(WAIT_S):
            async for _ in bucket.watch("nothing.>", timeout=0.2):
                pass


async def test_kv_per_key_ttl_expires_only_that_key(bus_factory: BusFactory) -> None:
    bucket = await (await bus_factory()).open_kv(bucket_name())
    await bucket.put("lease", b"held", ttl_s=1)
    await bucket.put("config", b"kept")
    assert await bucket.get("lease") == b"held"
    assert await gone(bucket, "lease")
    assert await bucket.get("config") == b"kept"
    with pytest.raises(ValueError):
        await bucket.put("lease", b"x", ttl_s=0.5)


async def test_kv_bucket_ttl_expires_every_key(bus_factory: BusFactory) -> None:
    bucket = await (await bus_factory()).open_kv(bucket_name(), ttl_s=1)
    await bucket.put("a", b"1")
    assert await bucket.get("a") == b"1"
    assert await gone(bucket, "a")
    assert await bucket.history("a") == []


async def test_kv_value_above_max_payload_is_refused(
    bus_factory: BusFactory, bus_kind: str
) -> None:
    options = {"max_payload": 4 << 20} if bus_kind == "memory" else {}  # the server's
    bus = await bus_factory(**options)
    bucket = await bus.open_kv(bucket_name())
    with pytest.raises(ValueTooLargeError):
        await bucket.put("big", b"x" * ((4 << 20) + 1))
    assert await bucket.get("big") is None


# ---- object stores --------------------------------------------------------------------------


async def test_objects_round_trip_with_their_sizes_and_writers(bus_factory: BusFactory) -> None:
    a, b = await bus_factory(), await bus_factory()
    name = bucket_name()
    store, theirs = await a.open_object_store(name), await b.open_object_store(name)
    big = os.urandom(5 << 20)  # above the server's max_payload: chunked on NATS
    assert await store.put("big", big, writer="tier-a")
    assert await store.put("empty", b"")
    assert await theirs.put("small", b"x" * 10)
    assert await theirs.get("big") == big and await store.get("empty") == b""
    assert await store.get("absent") is None and await store.info("absent") is None
    info = await theirs.info("big")
    assert info is not None and (info.size, info.writer) == (5 << 20, "tier-a")
    assert [(e.name, e.size) for e in await store.list()] == [
        ("big", 5 << 20),
        ("empty", 0),
        ("small", 10),
    ]
    assert await store.put("big", b"smaller", writer="tier-b")  # replaced: listed last now
    assert [e.name for e in await theirs.list()] == ["empty", "small", "big"]
    assert await theirs.get("big") == b"smaller"
    assert await store.delete("small") and not await theirs.delete("small")
    assert [e.name for e in await theirs.list()] == ["empty", "big"]
    await store.close()


async def corrupt(store: ObjectStore, name: str) -> None:
    """Make ``name``'s bytes disagree with its recorded SHA-256."""
    if isinstance(store, MemoryObjectStore):
        held = store._state.objects[name]
        store._state.objects[name] = replace(held, data=held.data[:-1] + b"?")
        return
    assert isinstance(store, object_store.NatsObjectStore)
    meta = await store._last_meta(name)
    assert meta is not None
    info = meta.info.as_dict()
    info["digest"] = "SHA-256=" + hashlib.sha256(b"other bytes").hexdigest()
    subject = store._meta_subject(name)
    await store._js.publish(subject, json.dumps(info).encode(), headers={"Nats-Rollup": "sub"})


async def test_a_read_checks_the_digest(bus_factory: BusFactory) -> None:
    store = await (await bus_factory()).open_object_store(bucket_name())
    await store.put("chunk", os.urandom(300_000))
    await corrupt(store, "chunk")
    with pytest.raises(PayloadIntegrityError):
        await store.get("chunk")


@pytest.fixture
def held_digests(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Digests of data starting ``b"slow"`` say they ``entered`` and wait (in their thread)
    until ``release`` is set."""
    held = SimpleNamespace(entered=threading.Event(), release=threading.Event())

    def sha256(data: bytes) -> Any:
        if bytes(data[:4]) == b"slow":
            held.entered.set()
            held.release.wait(WAIT_S)
        return hashlib.sha256(data)

    fake = SimpleNamespace(sha256=sha256)
    monkeypatch.setattr(object_store, "hashlib", fake)
    monkeypatch.setattr(memory_jetstream, "hashlib", fake)
    return held


@pytest.mark.parametrize("meanwhile", ["put", "put-then-delete"])
async def test_of_overlapping_puts_the_first_to_finish_wins(
    bus_factory: BusFactory, held_digests: SimpleNamespace, meanwhile: str
) -> None:
    """A put that read the name's object before another put of it finished loses (False, its
    object left nowhere); an object deleted meanwhile is no winner: the slow put stores."""
    name = bucket_name()
    store = await (await bus_factory()).open_object_store(name)
    other = await (await bus_factory()).open_object_store(name)
    assert await store.put("k", b"first bytes")
    slow = asyncio.create_task(store.put("k", b"slow bytes", writer="a"))
    assert await asyncio.to_thread(held_digests.entered.wait, WAIT_S)  # it read the name
    assert await other.put("k", b"fast bytes", writer="b")
    if meanwhile == "put-then-delete":
        assert await other.delete("k")
    held_digests.release.set()
    async with asyncio.timeout(WAIT_S):
        stored = await slow
    if meanwhile == "put":
        assert not stored and await store.get("k") == b"fast bytes"
        assert [(e.name, e.writer) for e in await store.list()] == [("k", "b")]
    else:
        assert stored and await other.get("k") == b"slow bytes"
    await store.close()
    assert store.num_orphans == 0
