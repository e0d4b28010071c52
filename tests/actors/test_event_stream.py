"""``Bus.open_stream`` on both buses: idempotent creation, every stored message replayed in
order then live ones, retention by count, shared by every connection, info and purge."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

from shoal.bus.base import Bus
from shoal.bus.msg import Msg

BusFactory = Callable[..., Awaitable[Bus]]


def names() -> tuple[str, str]:
    token = uuid.uuid4().hex[:8]
    return f"s-{token}", f"t{token}.events.*"


async def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def test_a_follower_gets_the_stored_messages_in_order_then_live_ones(
    bus_factory: BusFactory,
) -> None:
    publisher, follower_bus = await bus_factory(), await bus_factory()
    name, subject = names()
    prefix = subject[:-2]
    await publisher.open_stream(name, [subject], max_msgs=5)
    stream = await follower_bus.open_stream(name, [subject], max_msgs=5)  # already there
    for i in range(8):
        await publisher.publish(f"{prefix}.e{i % 2}", str(i).encode())
    await publisher.publish("elsewhere.events.e0", b"not captured")
    await publisher.flush()
    async with asyncio.timeout(10):  # JetStream stores asynchronously
        while (await stream.info()).num_msgs < 5 or (await stream.info()).last_seq < 8:
            await asyncio.sleep(0.01)
    got: list[Msg] = []

    async def handle(msg: Msg) -> None:
        got.append(msg)

    follower = await stream.follow(handle)
    async with asyncio.timeout(10):
        await follower.caught_up.wait()
    assert [m.data for m in got] == [b"3", b"4", b"5", b"6", b"7"]  # the last 5 (max_msgs)
    assert got[0].subject == f"{prefix}.e1"
    await publisher.publish(f"{prefix}.e0", b"8")
    await wait_for(lambda: len(got) == 6)
    assert got[-1].data == b"8"
    info = await stream.info()
    assert (info.num_msgs, info.last_seq) == (5, 9)
    await stream.purge()
    assert (await stream.info()).num_msgs == 0
    await follower.stop()
    empty = await stream.follow(handle)
    assert empty.caught_up.is_set()  # nothing stored: caught up at once
    await empty.stop()
