"""Buses connected as a namespace's per-role NATS users (``bus.permissions``), for the tests
that run a real nats-server with the generated authorization config: ``connect(role)`` gives a
connected ``NatsBus``; every one is closed at the end."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from shoal.bus.nats_bus import NatsBus
from shoal.bus.permissions import user_name


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
