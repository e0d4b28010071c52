"""Buses connected as a namespace's per-role NATS users (``bus.nats_ops.permissions``), for the
tests that run a real nats-server with the generated authorization config: ``role_buses`` gives
``connect(role)`` (a connected ``NatsBus``; every one closed at the end), ``role_deployment``
a whole deployment with each actor on its role's bus."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from shoal.bus.nats_ops.permissions import user_name
from shoal.bus.runtime.actor import Actor
from shoal.bus.transport.nats_bus import NatsBus
from shoal.config.deployment import ShoalConfig
from shoal.deploy.deployment import plan_actors, start_in_process, stop_in_process
from shoal.deploy.nats_init import provision
from shoal.engine.client.engine_client import AsyncEngineClient
from shoal.gateway.actor import GatewayActor


@contextlib.asynccontextmanager
async def role_buses(
    url: str, namespace: str, passwords: Mapping[str, str]
) -> AsyncIterator[Callable[[str], Awaitable[NatsBus]]]:
    buses: list[NatsBus] = []

    async def connect(role: str) -> NatsBus:
        bus = NatsBus([url], user=user_name(namespace, role), password=passwords[role])
        await bus.connect()
        buses.append(bus)
        return bus

    try:
        yield connect
    finally:
        for bus in reversed(buses):
            await bus.close()


@dataclass
class RoleDeployment:
    """A whole deployment, each actor on its role's bus: ``buses`` by role (the gateway's too),
    the actors, the gateway's bus."""

    buses: dict[str, NatsBus]
    actors: list[Actor]
    gateway_bus: NatsBus

    def violations(self) -> dict[str, list[str]]:
        """Each role's refusals by the server (none expected)."""
        return {
            role: list(bus.permission_violations)
            for role, bus in self.buses.items()
            if bus.num_permission_violations
        }


@contextlib.asynccontextmanager
async def role_deployment(
    connect: Callable[[str], Awaitable[NatsBus]], config: ShoalConfig, ready_timeout_s: float
) -> AsyncIterator[RoleDeployment]:
    """``config``'s buckets made by the provisioner, every actor of its plan started on its
    role's bus, then the engine client and a gateway actor (NATS API) on the gateway's."""
    namespace = config.bus_config.namespace
    await provision(await connect("provisioner"), namespace)
    plans = plan_actors(config)
    buses = {kind: await connect(kind) for kind in {plan.kind for plan in plans}}
    actors: list[Actor] = []
    try:
        for plan in plans:
            actors += await start_in_process(buses[plan.kind], [plan])
        gateway_bus = buses["gateway"] = await connect("gateway")
        client = await AsyncEngineClient(gateway_bus, config).start()
        await client.wait_until_ready(ready_timeout_s)
        gateway = GatewayActor(
            gateway_bus, "gateway-0", config=config, engine_client=client, port=0
        )
        await gateway.start()
        try:
            yield RoleDeployment(buses, actors, gateway_bus)
        finally:
            await gateway.stop()
            await client.close()
    finally:
        await stop_in_process(actors)
