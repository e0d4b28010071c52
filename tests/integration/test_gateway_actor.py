"""The gateway actor: HTTP, the NATS API and the engine-stats feed of /metrics start and stop
together on one bus; a stopping gateway answers /health 503 for its shutdown delay first."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal.bus.codec import encode
from shoal.bus.messages.control import ActorState, Heartbeat
from shoal.bus.messages.engine import EngineStats, SchedulerStats
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.config.deployment import ShoalConfig
from shoal.gateway.actor import GatewayActor
from tests.integration.conditions import wait_for
from tests.unit.test_gateway_fake import FakeEngineClient

pytestmark = pytest.mark.timeout(60)


def _gauge(text: str, name: str, engine: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("engine") == engine:
                return sample.value
    return None


async def test_actor_serves_http_nats_and_engine_stats() -> None:
    broker = InMemoryBroker()
    bus, client_bus = InMemoryBus(broker), InMemoryBus(broker)
    await client_bus.connect()
    actor = GatewayActor(
        bus,
        "gw-0",
        config=ShoalConfig.from_options(model="fake", max_model_len=128, namespace="acttest"),
        engine_factory="tests.unit.test_gateway_fake:make_fake_engine",
        port=0,
        heartbeat_interval_s=0.05,
    )
    await actor.start()
    try:
        assert actor.http is not None
        url = actor.http.url
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "the fox", "max_tokens": 3}
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200
                assert (await response.json())["usage"]["completion_tokens"] == 3
            reply = await client_bus.request(
                actor.subjects.api_generate(), b'{"prompt": "the fox"}', timeout=10
            )
            assert msgspec.json.decode(reply.data)["type"] == "result"
            stats = SchedulerStats(num_running=5, num_waiting=2, kv_usage=0.25)
            event = EngineStats("e0", stats, time.time())
            await client_bus.publish(actor.subjects.engine_stats("e0"), encode(event))
            metrics = actor.metrics
            assert metrics is not None
            running = {"model_name": "fake-model", "engine": "e0"}
            await wait_for(
                lambda: (
                    metrics.registry.get_sample_value("vllm:num_requests_running", running)
                    is not None
                ),
                10.0,
                "the engine stats in the registry",
            )
            async with session.get(url + "/metrics") as response:
                text = await response.text()
            assert _gauge(text, "vllm:num_requests_running", "e0") == 5
            assert _gauge(text, "vllm:num_requests_waiting", "e0") == 2
            assert _gauge(text, "vllm:kv_cache_usage_perc", "e0") == 0.25
            assert actor.load() == {"requests_in_flight": 0.0}
    finally:
        await actor.stop()
        await client_bus.close()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(url + "/health")


class ReportingEngine(FakeEngineClient):
    """A fake that passes engine stats on to listeners, like AsyncEngineClient."""

    def __init__(self) -> None:
        super().__init__()
        self.stats_listeners: list = []  # type: ignore[type-arg]


async def test_actor_takes_stats_from_the_engine_client_when_it_reports_them() -> None:
    bus = InMemoryBus(InMemoryBroker())
    engine = ReportingEngine()
    actor = GatewayActor(bus, "gw-1", engine_client=engine, port=0, namespace="acttest2")
    await actor.start()
    try:
        # no engine-stats inbox (the client passes them on), only the tiers' heartbeats
        assert [i.subject for i in actor.inboxes()] == [actor.subjects.heartbeat("tier")]
        assert len(engine.stats_listeners) == 1
        engine.stats_listeners[0](SchedulerStats(num_running=3), "e9")
        assert actor.metrics is not None
        sample = actor.metrics.registry.get_sample_value(
            "vllm:num_requests_running", {"model_name": engine.model_name, "engine": "e9"}
        )
        assert sample == 3
        load = {"num_queries": 7.0, "backpressure_dropped:kv-cpu-fs0": 2.0}
        beat = Heartbeat("kv-cpu", "tier", 1, ActorState.READY, time.time(), load, "life1")
        await bus.publish(actor.subjects.heartbeat("tier"), encode(beat))
        labels = {"model_name": engine.model_name, "tier": "kv-cpu"}
        registry = actor.metrics.registry

        def queries() -> float | None:
            return registry.get_sample_value("vllm:kv_offload_tiering_chunk_queries_total", labels)

        await wait_for(lambda: queries() == 7.0, 5, "the tier's counters on /metrics")
        dropped = "vllm:kv_offload_tiering_backpressure_dropped_stores_total"
        fs_labels = {**labels, "tier": "kv-cpu-fs0"}  # the CPU tier's drops for its secondary
        assert registry.get_sample_value(dropped, fs_labels) == 2.0
    finally:
        await actor.stop()
    assert engine.stats_listeners == []  # a stopped gateway no longer listens to a shared client


@pytest.mark.parametrize("trusted", [False, True])
async def test_the_deployments_trust_in_request_chat_templates_reaches_http_and_nats(
    trusted: bool,
) -> None:
    """``--trust-request-chat-template`` (off by default, as in vLLM) decides for both APIs
    whether a request may bring its own chat template."""
    broker = InMemoryBroker()
    bus, client_bus = InMemoryBus(broker), InMemoryBus(broker)
    await client_bus.connect()
    config = ShoalConfig.from_options(
        model="fake", namespace="trusttest", trust_request_chat_template=trusted
    )
    actor = GatewayActor(
        bus, "gw-0", config=config,
        engine_factory="tests.unit.test_gateway_fake:make_fake_engine", port=0,
    )  # fmt: skip
    await actor.start()
    chat = {
        "messages": [{"role": "user", "content": "the fox"}],
        "chat_template": "{{ messages[0]['content'] }}",
        "max_tokens": 2,
    }
    try:
        assert actor.http is not None
        async with (
            aiohttp.ClientSession() as session,
            session.post(actor.http.url + "/v1/chat/completions", json=chat) as response,
        ):
            assert response.status == (200 if trusted else 400), await response.text()
        nats = {k: v for k, v in chat.items() if k != "max_tokens"}
        nats["sampling_params"] = {"max_tokens": 2}
        reply = await client_bus.request(
            actor.subjects.api_generate(), msgspec.json.encode(nats), timeout=10
        )
        assert msgspec.json.decode(reply.data)["type"] == ("result" if trusted else "error")
    finally:
        await actor.stop()
        await client_bus.close()


async def test_a_stopping_gateway_fails_health_but_keeps_serving_for_its_shutdown_delay() -> None:
    broker = InMemoryBroker()
    actor = GatewayActor(
        InMemoryBus(broker), "gw-1",
        config=ShoalConfig.from_options(model="fake", max_model_len=128, namespace="acttest"),
        engine_factory="tests.unit.test_gateway_fake:make_fake_engine", port=0,
        shutdown_delay_s=1.0,
    )  # fmt: skip
    await actor.start()
    assert actor.http is not None
    url = actor.http.url
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/health") as response:
            assert response.status == 200
        stopping = asyncio.create_task(actor.stop())
        await wait_for(lambda: actor.state is ActorState.DRAINING, 10.0, "the gateway draining")
        async with session.get(url + "/health") as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == "draining"
        body = {"prompt": "the fox", "max_tokens": 3}
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200  # a request its load balancer still sent
        assert not stopping.done()
        await stopping
        with pytest.raises(aiohttp.ClientConnectorError):
            await session.get(url + "/health")


@pytest.mark.parametrize("heard", [True, False])
async def test_a_new_gateway_opens_its_port_once_it_has_heard_an_engine_core(heard: bool) -> None:
    """Restarted beside running engine cores, a gateway knows none until their next heartbeats:
    it listens for a few heartbeat intervals first, so a request cannot find it knowing none;
    if none is heard by then it opens anyway, and ``/health`` says no engine core is ready."""
    engine = FakeEngineClient()
    engine.ready = False
    actor = GatewayActor(
        InMemoryBus(InMemoryBroker()), "gw-2", engine_client=engine, port=0,
        heartbeat_interval_s=0.2,
    )  # fmt: skip
    starting = asyncio.create_task(actor.start())
    try:
        await asyncio.sleep(0.3)
        assert actor.http is None and not starting.done()
        engine.ready = heard
        await asyncio.wait_for(starting, 10.0)
        assert actor.http is not None
        async with (
            aiohttp.ClientSession() as session,
            session.get(actor.http.url + "/health") as response,
        ):
            assert response.status == (200 if heard else 503)
    finally:
        await actor.stop()
