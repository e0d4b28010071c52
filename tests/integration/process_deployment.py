"""A deployment with every actor in its own process over a real nats-server (the supervisor runs
them), an engine client beside it, and what one engine core publishes on its stats subject: the
harness of the tests that check what the engine core did from another process."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shoal.bus import connect_bus
from shoal.bus.codec import Codec
from shoal.bus.messages.engine import EngineStats, SchedulerStats
from shoal.bus.msg import Msg
from shoal.bus.runtime.supervisor import ActorSpec, Supervisor
from shoal.bus.subjects import Subjects
from shoal.config.deployment import ShoalConfig
from shoal.deploy.deployment import plan_actors
from shoal.engine.client.engine_client import AsyncEngineClient
from tests.integration.conditions import wait_for

FAST_HEARTBEATS = {"heartbeat_interval_s": 0.2}


class PublishedStats:
    """The latest ``EngineStats`` an engine core published on its stats subject."""

    def __init__(self) -> None:
        self.latest: EngineStats | None = None
        self._codec: Codec[EngineStats] = Codec(EngineStats)

    async def on_msg(self, msg: Msg) -> None:
        self.latest = self._codec.decode(msg.data)

    @property
    def stats(self) -> SchedulerStats:
        assert self.latest is not None
        return self.latest.stats

    def num_finished(self) -> int:
        s = self.stats
        return s.num_finished_stop + s.num_finished_length + s.num_finished_abort


@dataclass
class ProcessDeployment:
    client: AsyncEngineClient
    published: PublishedStats  # of ``engine-0``
    supervisor: Supervisor


@contextlib.asynccontextmanager
async def process_deployment(
    nats_url: str,
    config: ShoalConfig,
    tp_init_methods: list[str] | None = None,
    ep_init_method: str | None = None,
) -> AsyncIterator[ProcessDeployment]:
    """``config``'s actors as supervised processes with fast heartbeats, and a started client
    that has seen every engine core ready and engine-0's first stats (``tp_init_methods``: the
    tensor-parallel rendezvous of each engine core, ``ep_init_method`` the expert-parallel
    group's, as ``plan_actors`` takes them)."""
    namespace = config.bus_config.namespace
    specs = [
        ActorSpec(p.name, p.target, nats_url, {**p.kwargs, **FAST_HEARTBEATS}, kind=p.kind)
        for p in plan_actors(config, tp_init_methods=tp_init_methods, ep_init_method=ep_init_method)
    ]
    bus = await connect_bus(nats_url)
    published = PublishedStats()
    await bus.subscribe(Subjects(namespace).engine_stats("engine-0"), published.on_msg)
    supervisor = Supervisor(specs, status_bus=bus, namespace=namespace)
    await supervisor.start()
    client = AsyncEngineClient(bus, config)
    await client.start()
    try:
        num_engines = config.parallel_config.data_parallel_size
        await client.wait_until_ready(120, num_engines=num_engines)
        await wait_for(lambda: published.latest is not None, 30, "engine stats")
        yield ProcessDeployment(client, published, supervisor)
    finally:
        await client.close()
        await supervisor.stop()
        await bus.close()
