"""The engine client (fault tolerance off) against a fake engine core on the in-memory bus: the
requests it sent to an engine core end with finish reason "error" as soon as that engine core
shows a new incarnation (a restarted process) or is reported dead, and only those; late
messages of the old incarnation change nothing. When the client's own bus connection comes back
after a loss, every request it had in flight ends the same way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from shoal.bus.messages.control import ActorState
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.subjects import Subjects
from shoal.bus.transport.memory import InMemoryBus
from shoal.config.deployment import ShoalConfig
from shoal.engine.client.collector import RequestOutputCollector
from shoal.engine.client.engine_client import AsyncEngineClient
from shoal.engine.client.outputs import RequestOutput
from tests.actors.fake_engine_core import FakeEngine
from tests.integration.conditions import wait_for as wait_until

NAMESPACE = "restarts"
SUBJECTS = Subjects(NAMESPACE)
LIMIT_S = 5.0
PARAMS = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


async def wait_for(condition: Callable[[], bool]) -> None:
    await wait_until(condition, LIMIT_S, "the engine client's view")


@pytest.fixture
async def setup(tiny_checkpoint) -> AsyncIterator[tuple[AsyncEngineClient, FakeEngine, FakeEngine]]:  # type: ignore[no-untyped-def]
    bus = InMemoryBus()
    await bus.connect()
    config = ShoalConfig.from_options(
        model=str(tiny_checkpoint("llama")), namespace=NAMESPACE, enable_fault_tolerance=False
    )  # what fails requests without fault tolerance (with it they resume: elsewhere)
    engines = (FakeEngine(bus, SUBJECTS, "e0"), FakeEngine(bus, SUBJECTS, "e1"))
    client = AsyncEngineClient(bus, config)
    await client.start()
    for engine in engines:
        await engine.start()
        await engine.stats("a")
    await client.wait_until_ready(LIMIT_S, num_engines=2)
    yield client, *engines
    await client.close()
    await bus.close()


async def send(
    client: AsyncEngineClient, engine: FakeEngine, request_id: str
) -> RequestOutputCollector:
    """A request that the router sent to ``engine`` (the other one is made to look busier)."""
    for view in client.router.engines.values():
        view.num_sent_since_stats = 0 if view.engine_id == engine.engine_id else 1000
    collector = await client.add_request([5, 6, 7], PARAMS, request_id)
    assert client.placements.engine_of(request_id) == engine.engine_id
    await wait_for(lambda: request_id in engine.adds)
    return collector


async def error_of(collector: RequestOutputCollector) -> RequestOutput:
    output = await asyncio.wait_for(collector.get(), LIMIT_S)
    assert output.finished and output.outputs[0].finish_reason == "error", output
    assert output.error is not None
    return output


async def test_a_new_incarnation_fails_the_requests_sent_to_the_old_one(setup) -> None:  # type: ignore[no-untyped-def]
    client, e0, e1 = setup
    doomed = [await send(client, e0, f"old{i}") for i in range(3)]
    survivor = await send(client, e1, "other")
    await e0.heartbeat("a")  # the same life: nothing happens
    await e0.heartbeat("b")  # a restarted process
    for collector in doomed:
        assert "restarted" in (await error_of(collector)).error  # type: ignore[operator]
    await wait_for(lambda: {"old0", "old1", "old2"} <= set(e0.aborts))
    assert set(client.placements.placed()) == {"other"} and survivor.get_nowait() is None
    # The new life takes requests, and late messages of the old one fail nothing.
    fresh = await send(client, e0, "new")
    await e0.heartbeat("a")
    await e0.stats("a")
    await e0.heartbeat("b")
    await e0.stats("b")
    await client.bus.flush()
    assert set(client.placements.placed()) == {"other", "new"} and fresh.get_nowait() is None


async def test_stats_of_a_new_incarnation_fail_the_requests_too(setup) -> None:  # type: ignore[no-untyped-def]
    client, e0, _ = setup
    collector = await send(client, e0, "r")
    await e0.stats("b")
    await error_of(collector)


async def test_a_dead_status_fails_the_requests_at_once(setup) -> None:  # type: ignore[no-untyped-def]
    """The supervisor's DEAD (no incarnation): no wait for the watchdog's next round."""
    client, e0, e1 = setup
    assert client._watchdog is not None
    client._watchdog.cancel()  # what follows owes nothing to the watchdog's rounds
    collector = await send(client, e0, "r")
    survivor = await send(client, e1, "s")
    await e0.status(ActorState.DEAD)
    assert "gone" in (await error_of(collector)).error  # type: ignore[operator]
    assert set(client.placements.placed()) == {"s"} and survivor.get_nowait() is None


async def test_the_clients_own_reconnect_fails_every_request_in_flight(setup) -> None:  # type: ignore[no-untyped-def]
    """Outputs in flight went down with the connection: no request may wait for them."""
    client, e0, e1 = setup
    doomed = [await send(client, e0, "r0"), await send(client, e1, "r1")]
    client.bus._reconnected()  # what NatsBus does when its connection is back
    for collector in doomed:
        assert "connection was lost" in (await error_of(collector)).error  # type: ignore[operator]
    await wait_for(lambda: "r0" in e0.aborts and "r1" in e1.aborts)
    assert not client.placements.placed()
    fresh = await send(client, e0, "after")
    assert fresh.get_nowait() is None and set(client.placements.placed()) == {"after"}
