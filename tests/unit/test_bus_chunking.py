"""Chunked transfer of large payloads, on the in-memory bus with a tiny max_payload."""

from __future__ import annotations

import asyncio
import os

import pytest

from shoal.bus.errors import PayloadIntegrityError
from shoal.bus.msg import Msg
from shoal.bus.transport.chunking import CHUNKED_HEADER, ChunkSender, fetch_chunked
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.bus.transport.nats_bus import _user_transfer_prefix


async def make_pair(max_payload: int = 1000) -> tuple[InMemoryBus, InMemoryBus]:
    broker = InMemoryBroker()
    a = InMemoryBus(broker, max_payload=max_payload)
    b = InMemoryBus(broker, max_payload=max_payload)
    await a.connect()
    await b.connect()
    return a, b


async def test_chunked_request_and_reply_round_trip_and_free_the_reply():
    server, client = await make_pair()
    seen: list[Msg] = []

    async def echo(msg: Msg) -> None:
        seen.append(msg)
        await msg.respond(msg.data[::-1], headers={"Len": str(len(msg.data))})

    await server.subscribe("big.echo", echo)
    payload = os.urandom(10_500)  # 11 chunks of 1000 bytes
    reply = await client.request("big.echo", payload, timeout=5)
    assert reply.data == payload[::-1]
    assert reply.header("Len") == "10500" and CHUNKED_HEADER not in (reply.headers or {})
    assert seen[0].data == payload and seen[0].reply
    assert server._chunks is not None and server._chunks.num_held == 0  # reply read once: freed
    await server.close()
    await client.close()


async def test_exactly_max_payload_is_not_chunked():
    server, client = await make_pair()
    got: list[Msg] = []

    async def take(msg: Msg) -> None:
        got.append(msg)

    await server.subscribe("t", take)
    await client.publish("t", b"x" * 1000)
    await asyncio.sleep(0.01)
    assert got[0].data == b"x" * 1000
    assert client._chunks is not None and client._chunks.num_held == 0


async def test_tampered_digest_is_detected():
    sender_bus, receiver_bus = await make_pair()
    sender = ChunkSender(sender_bus, chunk_size=100)
    headers = await sender.offer("t", os.urandom(450), None)
    manifest = headers[CHUNKED_HEADER].rsplit(";", 1)[0] + ";" + "0" * 32
    msg = Msg(receiver_bus, "t", b"", None, {CHUNKED_HEADER: manifest})
    with pytest.raises(PayloadIntegrityError, match="digest"):
        await fetch_chunked(receiver_bus, msg, timeout=1)


async def test_a_sender_offers_under_its_users_prefix():
    """Connected as a user, a bus's transfers are pulled under ``_SHOAL_XFER.<user>``, the
    only transfers its permissions let it subscribe to (``bus.nats_ops.permissions``)."""
    sender_bus, receiver_bus = await make_pair()
    sender = ChunkSender(sender_bus, chunk_size=100, prefix=_user_transfer_prefix("ns-worker"))
    data = os.urandom(450)
    headers = await sender.offer("t", data, None)
    assert headers[CHUNKED_HEADER].startswith("_SHOAL_XFER.ns-worker.")
    got = await fetch_chunked(receiver_bus, Msg(receiver_bus, "t", b"", None, headers), timeout=1)
    assert got.data == data
    assert _user_transfer_prefix(None) == _user_transfer_prefix("not.a.token") == "_SHOAL_XFER"


async def test_expired_transfer_is_reported_not_hung():
    sender_bus, receiver_bus = await make_pair()
    sender = ChunkSender(sender_bus, chunk_size=100, ttl_s=0.0)
    headers = await sender.offer("t", os.urandom(450), None)
    await sender.offer("t", os.urandom(450), None)  # expires the first one
    msg = Msg(receiver_bus, "t", b"", None, headers)
    with pytest.raises(PayloadIntegrityError, match="gone"):
        await fetch_chunked(receiver_bus, msg, timeout=1)


async def test_malformed_manifest_is_an_integrity_error():
    _, receiver_bus = await make_pair()
    msg = Msg(receiver_bus, "t", b"", None, {CHUNKED_HEADER: "nonsense"})
    with pytest.raises(PayloadIntegrityError, match="malformed"):
        await fetch_chunked(receiver_bus, msg, timeout=1)


async def test_fan_out_subscribers_each_get_the_whole_payload():
    publisher, _ = await make_pair()
    receivers = [publisher.sibling() for _ in range(3)]
    got: list[bytes] = []

    async def take(msg: Msg) -> None:
        got.append(msg.data)

    for bus in receivers:
        await bus.connect()
        await bus.subscribe("fan", take)
    payload = os.urandom(5_000)
    await publisher.publish("fan", payload)
    async with asyncio.timeout(5):
        while len(got) < 3:
            await asyncio.sleep(0.005)
    assert got == [payload] * 3
