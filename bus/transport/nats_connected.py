"""``NatsConnectedBus``: the NATS bus as the JetStream pieces see it (``bus.jetstream.kv_bucket``,
``bus.jetstream.object_store``, ``bus.jetstream.nats_stream``, ``bus.jetstream.create``): a ``Bus``
with a nats-py client, the NATS user it connected as, and the server's permission refusals.
``NatsBus`` implements it; the pieces depend on this and ``NatsBus`` opens them, so neither imports
the other back."""

from __future__ import annotations

import abc
import asyncio

from nats.aio.client import Client

from shoal.bus.base import Bus


class NatsConnectedBus(Bus):
    user: str | None  # the NATS user connected as (None: no user)

    @property
    @abc.abstractmethod
    def client(self) -> Client:
        """The nats-py client (raises ``BusClosedError`` when not connected)."""

    @abc.abstractmethod
    def next_violation(self) -> asyncio.Future[str]:
        """A future set to the server's next permissions-violation message."""
