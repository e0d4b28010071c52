"""KV events through a real stream on both buses, with a small payload limit: a snapshot
larger than the limit goes out as several small batches that a restarted client replays whole
(an oversized message would be stored as its chunking stand-in, on either bus); snapshots come
again periodically and after a reconnect; retention is per engine core; NATS errors of a
stream are ``BusError``s."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from shoal.bus.base import Bus
from shoal.bus.codec import Codec
from shoal.bus.errors import BusError
from shoal.bus.messages.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from shoal.bus.msg import Msg
from shoal.bus.subjects import Subjects
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.config.deployment import CacheConfig, SchedulerConfig, ShoalConfig
from shoal.engine.actor.kv_events_link import KvEventsLink
from shoal.engine.client.prefix_routing import PrefixRouting
from shoal.engine.core.engine_core import EngineCore
from shoal.kv_events.stream import KV_EVENTS_MAX_MSGS_PER_ENGINE, open_kv_events_stream

MAX_PAYLOAD = 16 * 1024
BusFactory = Callable[[], Awaitable[Bus]]
_BATCH: Codec[KVEventBatch] = Codec(KVEventBatch)


@pytest.fixture
def small_server(bus_kind: str) -> Iterator[Any]:
    if bus_kind == "memory":
        yield None
        return
    from shoal.bus.nats_ops.server import NatsServer, NatsServerNotFoundError
    from tests.fixtures.nats import nats_server_missing

    try:
        server = NatsServer(max_payload=MAX_PAYLOAD)
    except NatsServerNotFoundError as exc:
        nats_server_missing(exc)
    with server:
        yield server


@pytest.fixture
async def small_bus(small_server: Any) -> AsyncIterator[BusFactory]:
    """Buses (one subject space) whose payloads above 16 KiB travel chunked."""
    from shoal.bus.transport.nats_bus import NatsBus

    buses: list[Bus] = []
    broker = InMemoryBroker()

    async def make() -> Bus:
        bus: Bus
        if small_server is None:
            bus = InMemoryBus(broker, max_payload=MAX_PAYLOAD)
        else:
            bus = NatsBus([small_server.url])
        await bus.connect()
        buses.append(bus)
        return bus

    yield make
    for bus in reversed(buses):
        await bus.close()


def fake_core(hashes: list[bytes]) -> EngineCore:
    """An engine core whose prefix cache holds ``hashes``."""
    core = EngineCore(SchedulerConfig(), CacheConfig(block_size=4), num_blocks=8, max_model_len=64)
    pool = core.scheduler.kv_cache_manager.block_pool
    pool.cached_hashes = lambda: list(hashes)  # type: ignore[method-assign]
    return core


def many_hashes(count: int) -> list[bytes]:
    return [i.to_bytes(32, "little") for i in range(count)]


async def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def stored(bus: Bus, subjects: Subjects, at_least: int = 0) -> list[KVEventBatch]:
    """Every batch the stream holds, once it holds ``at_least`` (a plain publish is stored by
    the server a moment after it returns)."""
    stream = await open_kv_events_stream(bus, subjects)
    async with asyncio.timeout(10):
        while (await stream.info()).num_msgs < at_least:
            await asyncio.sleep(0.01)
    got: list[Msg] = []

    async def handle(msg: Msg) -> None:
        got.append(msg)

    follower = await stream.follow(handle)
    await asyncio.wait_for(follower.caught_up.wait(), 10)
    await follower.stop()
    return [_BATCH.decode(msg.data) for msg in got]


async def test_a_snapshot_above_the_payload_limit_is_replayed_whole(small_bus: BusFactory) -> None:
    engine_bus, client_bus = await small_bus(), await small_bus()
    subjects = Subjects(f"kv{uuid.uuid4().hex[:8]}")
    link = KvEventsLink(engine_bus, subjects, "e0")
    await link.start()
    hashes = many_hashes(2000)  # about 70 KB of hashes
    await link.publish(fake_core(hashes), "life-1")
    assert link.num_published > 1
    batches = await stored(client_bus, subjects, link.num_published)  # none was chunked
    assert [b.seq for b in batches] == list(range(link.num_published))
    assert isinstance(batches[0].events[0], AllBlocksCleared)
    config = ShoalConfig.from_options(model="m", routing_mode="kv")
    routing = PrefixRouting(client_bus, subjects, config)  # a client started after it
    await routing.start()
    await wait_for(lambda: routing.index.hashes_of("e0") == set(hashes))
    assert routing.index.num_gaps == 0
    await routing.stop()
    link.stop()


async def test_a_message_above_the_limit_is_stored_as_its_stand_in_on_both_buses(
    small_bus: BusFactory,
) -> None:
    bus = await small_bus()
    token = uuid.uuid4().hex[:8]
    stream = await bus.open_stream(f"s-{token}", [f"t{token}.>"])
    await bus.publish(f"t{token}.big", b"x" * (3 * MAX_PAYLOAD))
    got: list[Msg] = []

    async def handle(msg: Msg) -> None:
        got.append(msg)

    follower = await stream.follow(handle)
    await wait_for(lambda: len(got) == 1)
    assert got[0].data != b"x" * (3 * MAX_PAYLOAD)  # the stand-in, as JetStream keeps it
    await follower.stop()


async def test_snapshots_come_periodically_and_after_a_reconnect(small_bus: BusFactory) -> None:
    engine_bus, client_bus = await small_bus(), await small_bus()
    subjects = Subjects(f"kv{uuid.uuid4().hex[:8]}")
    link = KvEventsLink(engine_bus, subjects, "e0", snapshot_interval_s=0.2)
    await link.start()
    core = fake_core(many_hashes(3))
    await link.publish(core, "life-1")
    await link.publish(core, "life-1")  # nothing changed, no snapshot due: nothing sent
    assert (link.num_published, link.num_snapshots) == (1, 1)
    await asyncio.sleep(0.25)
    await link.publish(core, "life-1")  # an idle engine core's periodic snapshot
    engine_bus._reconnected()  # as the transport reports a reconnect
    await link.publish(core, "life-1")
    assert (link.num_published, link.num_snapshots) == (3, 3)
    batches = await stored(client_bus, subjects, 3)
    assert [b.seq for b in batches] == [0, 1, 2]  # one life: seq goes on
    assert all(isinstance(b.events[0], AllBlocksCleared) for b in batches)
    assert all(isinstance(b.events[1], BlockStored) for b in batches)
    link.stop()


async def test_retention_is_per_subject_so_per_engine_core(small_bus: BusFactory) -> None:
    bus = await small_bus()
    token = uuid.uuid4().hex[:8]
    stream = await bus.open_stream(f"s-{token}", [f"t{token}.*"], max_msgs_per_subject=3)
    await bus.publish(f"t{token}.quiet", b"snapshot")
    for i in range(10):
        await bus.publish(f"t{token}.busy", str(i).encode())
    got: list[Msg] = []

    async def handle(msg: Msg) -> None:
        got.append(msg)

    async with asyncio.timeout(10):
        while (await stream.info()).last_seq < 11:
            await asyncio.sleep(0.01)
    follower = await stream.follow(handle)
    await wait_for(lambda: len(got) == 4)
    assert [m.data for m in got] == [b"snapshot", b"7", b"8", b"9"]
    await follower.stop()


async def test_the_kv_events_stream_keeps_per_engine_core_limits(bus_kind: str) -> None:
    """Its configuration as created (the memory store's; JetStream's below, on NATS)."""
    if bus_kind != "memory":
        pytest.skip("checked on NATS by test_nats_stream_errors_are_bus_errors' stream")
    bus = InMemoryBus(InMemoryBroker())
    await bus.connect()
    stream = await open_kv_events_stream(bus, Subjects("kvr"), snapshot_interval_s=30.0)
    store = stream._store  # type: ignore[attr-defined]
    assert store.max_msgs_per_subject == KV_EVENTS_MAX_MSGS_PER_ENGINE
    assert store.max_msgs is None and store.max_age_s == 120.0
    await bus.close()


@pytest.mark.parametrize("bus_kind", ["nats"])
async def test_nats_stream_errors_are_bus_errors(bus_factory: Any) -> None:
    bus = await bus_factory()
    subjects = Subjects(f"kv{uuid.uuid4().hex[:8]}")
    stream = await open_kv_events_stream(bus, subjects, snapshot_interval_s=30.0)
    js = bus.client.jetstream()
    config = (await js.stream_info(stream.name)).config
    assert config.max_msgs_per_subject == KV_EVENTS_MAX_MSGS_PER_ENGINE
    assert config.max_age == 120.0
    await js.delete_stream(stream.name)

    async def handle(msg: Msg) -> None:
        pass

    for call in (lambda: stream.follow(handle), stream.info, stream.purge):
        with pytest.raises(BusError):
            await call()
