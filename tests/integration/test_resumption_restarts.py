"""Resumption when an engine core is lost rather than faulted, against stand-in engine cores on
the in-memory bus (a real one cannot be made to vanish silently in-process): a new incarnation,
a DEAD report or silence re-sends the request's completion to a ready engine core with the
tokens already streamed (the old one gets an abort, its late outputs are dropped), or back to
the same engine core at once when it is a new incarnation; the caller's stream goes on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from shoal.bus.messages.control import ActorState
from shoal.bus.messages.engine import EngineCoreOutput
from shoal.bus.messages.sampling import OutputKind, SamplingParams
from shoal.bus.subjects import Subjects
from shoal.bus.transport.memory import InMemoryBus
from shoal.config.deployment import ShoalConfig
from shoal.engine.client.collector import RequestOutputCollector
from shoal.engine.client.engine_client import AsyncEngineClient
from shoal.gateway.app import create_app
from shoal.gateway.server import start_http_server
from tests.actors.fake_engine_core import FakeEngine
from tests.integration.conditions import wait_for

pytestmark = pytest.mark.timeout(60)

SUBJECTS = Subjects("resume")
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, output_kind=OutputKind.DELTA)
LIMIT_S = 10.0


@dataclass
class StandIn(FakeEngine):
    """A stand-in engine core that beats (stats and a READY heartbeat, as ``incarnation``)
    every 0.1 s while ``beating``."""

    incarnation: str = "a"
    beating: bool = True  # False: silent from now on

    async def start(self) -> None:
        await super().start()
        await self.beat()

    async def keep_beating(self) -> None:
        while True:
            if self.beating:
                await self.beat()
            await asyncio.sleep(0.1)

    async def beat(self) -> None:
        await self.stats(self.incarnation)
        await self.heartbeat(self.incarnation)

    async def emit(
        self, client: AsyncEngineClient, request_id: str, tokens: list[int], end: str | None = None
    ) -> None:
        await self.outputs(client.client_id, [EngineCoreOutput(request_id, tokens, end)])


@pytest.fixture
async def stack(tiny_checkpoint) -> AsyncIterator[tuple[AsyncEngineClient, StandIn, StandIn]]:  # type: ignore[no-untyped-def]
    bus = InMemoryBus()
    await bus.connect()
    config = ShoalConfig.from_options(
        model=str(tiny_checkpoint("llama")),
        namespace="resume",
        fault_tolerance_config={"request_resume_timeout_s": 5.0},
    )
    client = await AsyncEngineClient(bus, config, engine_stale_after_s=0.5).start()
    engines = (StandIn(bus, SUBJECTS, "e0"), StandIn(bus, SUBJECTS, "e1"))
    for engine in engines:
        await engine.start()
    beats = [asyncio.create_task(engine.keep_beating()) for engine in engines]
    await client.wait_until_ready(LIMIT_S, num_engines=2)
    yield client, *engines
    for task in beats:
        task.cancel()
    await client.close()
    await bus.close()


async def started_on(
    client: AsyncEngineClient, engine: StandIn, other: StandIn
) -> RequestOutputCollector:
    """A request routed to ``engine`` that streamed [11, 12] from it."""
    client.router.engines[other.engine_id].num_sent_since_stats = 1000
    collector = await client.add_request([5, 6, 7], PARAMS, "r")
    client.router.engines[other.engine_id].num_sent_since_stats = 0
    await wait_for(lambda: "r" in engine.adds, LIMIT_S, "the add arrives")
    await engine.emit(client, "r", [11, 12])
    first = await asyncio.wait_for(collector.get(), LIMIT_S)
    assert first.outputs[0].token_ids == [11, 12]
    return collector


async def finishes_after_resume(
    client: AsyncEngineClient, collector: RequestOutputCollector, old: StandIn, new: StandIn
) -> None:
    """The completion arrives again at ``new`` as "r@1" with the streamed tokens; the old
    engine core gets an abort and its late output is dropped; the stream goes on once."""
    await wait_for(lambda: "r@1" in new.adds, LIMIT_S, "resumed")
    add = new.adds["r@1"]
    assert (add.prompt_token_ids, add.output_token_ids) == ([5, 6, 7], [11, 12])
    assert add.sampling_params.max_tokens == PARAMS.max_tokens
    await wait_for(lambda: "r" in old.aborts, LIMIT_S, "the old attempt aborted")
    await old.emit(client, "r", [99])  # late, from the old attempt
    await new.emit(client, "r@1", [13], "length")
    last = await asyncio.wait_for(collector.get(), LIMIT_S)
    assert last.finished and last.outputs[0].token_ids == [13]
    assert last.outputs[0].finish_reason == "length" and collector.get_nowait() is None


async def test_a_new_incarnation_sends_the_request_to_a_ready_engine_core(stack) -> None:  # type: ignore[no-untyped-def]
    client, e0, e1 = stack
    collector = await started_on(client, e0, e1)
    e0.incarnation = "b"
    # the new incarnation is as ready as e1: either may take it, but only once
    await wait_for(lambda: "r@1" in e0.adds or "r@1" in e1.adds, LIMIT_S, "resumed")
    new = e0 if "r@1" in e0.adds else e1
    await finishes_after_resume(client, collector, e0, new)


async def test_a_dead_engine_cores_request_goes_to_the_other(stack) -> None:  # type: ignore[no-untyped-def]
    client, e0, e1 = stack
    collector = await started_on(client, e0, e1)
    e0.beating = False
    await e0.status(ActorState.DEAD, "a")
    await finishes_after_resume(client, collector, e0, e1)


async def test_a_silent_engine_cores_request_goes_to_the_other(stack) -> None:  # type: ignore[no-untyped-def]
    client, e0, e1 = stack
    collector = await started_on(client, e0, e1)
    e0.beating = False  # lost after twice the staleness, found by the watchdog
    await finishes_after_resume(client, collector, e0, e1)


async def test_a_new_incarnation_takes_its_requests_back_when_it_is_the_only_one(stack) -> None:  # type: ignore[no-untyped-def]
    client, e0, e1 = stack
    e1.beating = False
    await wait_for(lambda: not client.router.is_ready("e1"), LIMIT_S, "e1 gone stale")
    collector = await started_on(client, e0, e1)
    e0.incarnation = "b"  # restarted: a fresh process, ready at once
    await finishes_after_resume(client, collector, e0, e0)


async def test_a_new_request_waits_for_an_engine_core_while_every_one_is_down(stack) -> None:  # type: ignore[no-untyped-def]
    client, e0, e1 = stack
    e0.beating = e1.beating = False
    await wait_for(lambda: not client.is_ready(), LIMIT_S, "no engine core ready")
    collector = await client.add_request([5, 6, 7], PARAMS, "r")  # not refused: parked
    assert "r" in client.resumptions.parked
    e1.beating = True
    await wait_for(lambda: "r" in e1.adds, LIMIT_S, "sent once e1 is back")
    assert e1.adds["r"].output_token_ids == [] and "r" not in e0.adds
    await e1.emit(client, "r", [11], "length")
    last = await asyncio.wait_for(collector.get(), LIMIT_S)
    assert last.finished and last.outputs[0].token_ids == [11]


async def test_the_gateway_holds_a_request_while_every_engine_core_is_down(stack) -> None:  # type: ignore[no-untyped-def]
    """A rolling restart can leave a gateway seeing no ready engine core for a moment: its
    completion waits for one (not a 503), while ``/health`` tells load balancers the truth."""
    client, e0, e1 = stack
    server = await start_http_server(create_app(client, served_model_name="tiny"))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=LIMIT_S)) as http:
            e0.beating = e1.beating = False
            await wait_for(lambda: not client.is_ready(), LIMIT_S, "no engine core ready")
            async with http.get(server.url + "/health") as health:
                assert health.status == 503
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1}
            answer = asyncio.create_task(http.post(server.url + "/v1/completions", json=body))
            await wait_for(lambda: bool(client.resumptions.parked), LIMIT_S, "the add parked")
            e1.beating = True
            await wait_for(lambda: bool(e1.adds), LIMIT_S, "sent once e1 is back")
            (request_id,) = e1.adds
            await e1.emit(client, request_id, [11], "length")
            async with await answer as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["usage"]["completion_tokens"] == 1
            assert not e0.adds
    finally:
        await server.stop()
