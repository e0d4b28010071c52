"""The bus contract: every test runs on the in-memory bus and on a real nats-server."""

from __future__ import annotations

import asyncio
import os

import pytest

from shoal.bus.base import Bus, ReplyStream
from shoal.bus.errors import BusTimeoutError, NoRespondersError, RemoteError
from shoal.bus.msg import Msg
from shoal.bus.streams import request_stream
from shoal.bus.subjects import SubjectError
from tests.fixtures.nats import BusFactory
from tests.integration.conditions import wait_for

LIMIT_S = 5.0


class Inbox:
    """Collects delivered messages; ``wait(n)`` returns once n have arrived (bounded)."""

    def __init__(self) -> None:
        self.msgs: list[Msg] = []
        self._changed = asyncio.Event()

    async def __call__(self, msg: Msg) -> None:
        self.msgs.append(msg)
        self._changed.set()

    async def wait(self, n: int, timeout: float = LIMIT_S) -> list[Msg]:
        async with asyncio.timeout(timeout):
            while len(self.msgs) < n:
                self._changed.clear()
                await self._changed.wait()
        return self.msgs

    @property
    def data(self) -> list[bytes]:
        return [m.data for m in self.msgs]


async def echo(msg: Msg) -> None:
    await msg.respond(msg.data, headers=msg.headers)


async def settle(*buses: Bus) -> None:
    """Every subscription and unsubscription made on ``buses`` so far is known to the server (a
    round trip to it), so what is published next is routed by them."""
    for bus in buses:
        await bus.flush()


async def test_publish_reaches_every_subscriber_until_unsubscribed(bus_factory: BusFactory):
    bus, other = await bus_factory(), await bus_factory()
    first, second = Inbox(), Inbox()
    sub = await bus.subscribe("t.pub", first)
    await other.subscribe("t.pub", second)
    await settle(bus, other)
    await other.publish("t.pub", b"one", headers={"X-Trace": "7"})
    assert [m.data for m in await first.wait(1)] == [b"one"]
    assert (await second.wait(1))[0].headers == {"X-Trace": "7"}
    await sub.unsubscribe()
    await settle(bus)
    await other.publish("t.pub", b"two")
    await second.wait(2)
    assert first.data == [b"one"]  # the unsubscription was known before "two" was published


async def test_wildcards_match_one_token_and_the_rest(bus_factory: BusFactory):
    bus = await bus_factory()
    star, rest = Inbox(), Inbox()
    await bus.subscribe("w.*.stats", star)
    await bus.subscribe("w.>", rest)
    await settle(bus)
    for subject in ("w.e1.stats", "w.e2.stats", "w.e1.stats.extra", "w", "w.e1", "w.end.stats"):
        await bus.publish(subject, subject.encode())
    # "w.end.stats", published last, matches both: once it is in, nothing else is on its way
    await wait_for(
        lambda: b"w.end.stats" in star.data and b"w.end.stats" in rest.data, LIMIT_S, "the marker"
    )
    assert sorted(star.data) == [b"w.e1.stats", b"w.e2.stats", b"w.end.stats"]
    assert sorted(rest.data) == [
        b"w.e1",
        b"w.e1.stats",
        b"w.e1.stats.extra",
        b"w.e2.stats",
        b"w.end.stats",
    ]


async def test_queue_group_gives_each_message_to_one_member(bus_factory: BusFactory):
    publisher = await bus_factory()
    members = [Inbox() for _ in range(3)]
    member_buses = [await bus_factory() for _ in members]
    for bus, member in zip(member_buses, members, strict=True):
        await bus.subscribe("t.q", member, queue="pool")
    plain = Inbox()
    await publisher.subscribe("t.q", plain)
    await settle(publisher, *member_buses)
    num_messages = 90
    for i in range(num_messages):
        await publisher.publish("t.q", str(i).encode())
    await plain.wait(num_messages)
    await wait_for(
        lambda: sum(len(m.msgs) for m in members) >= num_messages, LIMIT_S, "every message"
    )
    received = sorted(int(d) for m in members for d in m.data)
    assert received == list(range(num_messages))  # each exactly once
    assert all(m.msgs for m in members)  # the load is spread


async def test_request_reply(bus_factory: BusFactory):
    server, client = await bus_factory(), await bus_factory()
    await server.subscribe("t.echo", echo)
    await settle(server)
    reply = await client.request("t.echo", b"hello", timeout=LIMIT_S, headers={"K": "v"})
    assert reply.data == b"hello"
    assert reply.header("K") == "v"


async def test_request_times_out_when_nobody_answers(bus_factory: BusFactory):
    server, client = await bus_factory(), await bus_factory()

    async def silent(msg: Msg) -> None:
        return None

    await server.subscribe("t.silent", silent)
    await settle(server)
    with pytest.raises(BusTimeoutError):
        await client.request("t.silent", b"?", timeout=0.2)


async def test_request_without_responders_fails_fast(bus_factory: BusFactory):
    client = await bus_factory()
    async with asyncio.timeout(LIMIT_S / 2):
        with pytest.raises(NoRespondersError):
            await client.request("t.nobody", b"?", timeout=LIMIT_S)
        with pytest.raises(NoRespondersError):
            async for _ in request_stream(client, "t.nobody", b"?", timeout=LIMIT_S):
                pass


async def test_streamed_reply_in_order_then_end_or_error(bus_factory: BusFactory):
    server, client = await bus_factory(), await bus_factory()

    async def count(msg: Msg) -> None:
        stream = ReplyStream(msg)
        n = int(msg.data)
        for i in range(n):
            await stream.send(str(i).encode())
        if n == 3:
            await stream.error("boom", code="test")
        else:
            await stream.end(b"done" if n else None)

    await server.subscribe("t.count", count)
    await settle(server)
    got = [m.data async for m in request_stream(client, "t.count", b"20", timeout=LIMIT_S)]
    assert got == [str(i).encode() for i in range(20)] + [b"done"]
    assert [m.data async for m in request_stream(client, "t.count", b"0", timeout=LIMIT_S)] == []
    received: list[bytes] = []
    with pytest.raises(RemoteError) as failure:
        async for msg in request_stream(client, "t.count", b"3", timeout=LIMIT_S):
            received.append(msg.data)
    assert received == [b"0", b"1", b"2"]
    assert (failure.value.code, failure.value.message) == ("test", "boom")


async def test_slow_handler_does_not_block_delivery(bus_factory: BusFactory):
    bus = await bus_factory()
    release = asyncio.Event()
    fast = Inbox()

    async def handler(msg: Msg) -> None:
        if msg.data == b"slow":
            await release.wait()
        await fast(msg)

    await bus.subscribe("t.slow", handler)
    await settle(bus)
    await bus.publish("t.slow", b"slow")
    await bus.publish("t.slow", b"fast")
    assert (await fast.wait(1))[0].data == b"fast"
    release.set()
    assert sorted(m.data for m in await fast.wait(2)) == [b"fast", b"slow"]


async def test_sequential_subscription_keeps_arrival_order(bus_factory: BusFactory):
    bus = await bus_factory()
    seen = Inbox()

    async def handler(msg: Msg) -> None:
        await asyncio.sleep(0.001 * (int(msg.data) % 3))  # uneven handler times, to keep order
        await seen(msg)

    await bus.subscribe("t.seq", handler, sequential=True)
    await settle(bus)
    for i in range(30):
        await bus.publish("t.seq", str(i).encode())
    assert [int(m.data) for m in await seen.wait(30)] == list(range(30))


async def test_16_mib_payload_publish_and_request(bus_factory: BusFactory, bus_kind: str):
    # the in-memory bus is given a 1 MiB max_payload so it chunks like NATS (4 MiB) does
    options = {"max_payload": 1 << 20} if bus_kind == "memory" else {}
    server, client = await bus_factory(**options), await bus_factory(**options)
    payload = os.urandom(16 << 20)
    received = Inbox()
    await server.subscribe("t.big", received)
    await server.subscribe("t.big.echo", echo)
    await settle(server)
    await client.publish("t.big", payload, headers={"Kind": "kv"})
    (msg,) = await received.wait(1, timeout=30)
    assert msg.data == payload and msg.header("Kind") == "kv"
    reply = await client.request("t.big.echo", payload, timeout=30)
    assert reply.data == payload


async def test_invalid_subjects_are_rejected(bus_factory: BusFactory):
    bus = await bus_factory()
    for bad in ("", "a..b", "a b", "a.*"):
        with pytest.raises(SubjectError):
            await bus.publish(bad, b"")
    with pytest.raises(SubjectError):
        await bus.subscribe("a.>.b", echo)


async def test_close_lets_running_handlers_finish(bus_factory: BusFactory):
    server, client = await bus_factory(), await bus_factory()
    started, finished = [], []

    async def slow_echo(msg: Msg) -> None:
        started.append(msg.data)
        await asyncio.sleep(0.2)  # paces the handler: it is still running when close begins
        finished.append(msg.data)
        await msg.respond(msg.data)

    await server.subscribe("t.drain", slow_echo)
    await settle(server)
    pending = asyncio.create_task(client.request("t.drain", b"x", timeout=LIMIT_S))
    await wait_for(lambda: started, LIMIT_S, "the handler started")
    await server.close()
    assert finished == [b"x"]
    assert (await pending).data == b"x"


async def test_close_lets_queued_sequential_handlers_finish(bus_factory: BusFactory):
    server, client = await bus_factory(), await bus_factory()
    started: list[bytes] = []

    async def slow_echo(msg: Msg) -> None:
        started.append(msg.data)
        await asyncio.sleep(0.1)  # paces the handler, so the second waits behind it
        await msg.respond(msg.data)

    sub = await server.subscribe("t.seqdrain", slow_echo, sequential=True)
    await settle(server)
    pending = [
        asyncio.create_task(client.request("t.seqdrain", data, timeout=LIMIT_S))
        for data in (b"1", b"2")
    ]
    dispatcher = sub.dispatcher  # type: ignore[attr-defined]
    # the first runs, the second waits in the queue
    await wait_for(
        lambda: started and dispatcher.num_pending == 1, LIMIT_S, "one running, one queued"
    )
    await server.close()
    assert started == [b"1", b"2"]
    assert [(await p).data for p in pending] == [b"1", b"2"]


async def test_streamed_reply_keeps_order_across_a_chunked_message(
    bus_factory: BusFactory, bus_kind: str
):
    options = {"max_payload": 1 << 20} if bus_kind == "memory" else {}
    server, client = await bus_factory(**options), await bus_factory(**options)
    big = os.urandom(6 << 20)  # chunked on both transports

    async def stream_big_then_small(msg: Msg) -> None:
        stream = ReplyStream(msg)
        await stream.send(b"first")
        await stream.send(big)
        await stream.end(b"last")

    await server.subscribe("t.bigstream", stream_big_then_small)
    await settle(server)
    got = [m.data async for m in request_stream(client, "t.bigstream", b"", timeout=30)]
    assert got == [b"first", big, b"last"]
