"""shoal's message bus, grouped by role: the ``Bus`` interface (``bus.base``; its messages
``bus.msg``, errors ``bus.errors``, streamed replies ``bus.streams``, event streams
``bus.event_stream``, buckets and object stores ``bus.buckets``), subjects (``bus.subjects``),
codecs (``bus.codec``) and the wire schemas (``bus.messages``); the transports
(``bus.transport``: in-memory and NATS); JetStream on NATS (``bus.jetstream``); the actor
runtime (``bus.runtime``: the actor base, liveness, processes and their supervisor); and NATS
operations (``bus.nats_ops``: the local nats-server, clusters, permissions, credentials). Only
this package imports ``nats``. See ``docs/bus.md``."""

from __future__ import annotations

from typing import Any

from shoal.bus.base import Bus, ReplyStream, Subscription
from shoal.bus.errors import (
    BusClosedError,
    BusError,
    BusTimeoutError,
    NoRespondersError,
    PayloadIntegrityError,
    RemoteError,
)
from shoal.bus.msg import Handler, Msg
from shoal.bus.subjects import SubjectError, Subjects

__all__ = [
    "Bus",
    "BusClosedError",
    "BusError",
    "BusTimeoutError",
    "Handler",
    "Msg",
    "NoRespondersError",
    "PayloadIntegrityError",
    "RemoteError",
    "ReplyStream",
    "SubjectError",
    "Subjects",
    "Subscription",
    "connect_bus",
    "make_bus",
]


def make_bus(url: str = "memory", **options: Any) -> Bus:
    """A bus for ``url``, not yet connected.

    ``"memory"`` / ``"memory://NAME"``: an ``InMemoryBus`` on the process-wide broker NAME
    (default ``"default"``); options go to ``InMemoryBus``. ``"nats://host:port"`` (comma-separated
    for several servers; ``tls://`` too): a ``NatsBus``; options go to ``NatsBus`` (user, password,
    token, creds_file, tls, name, …).
    """
    if url == "memory" or url.startswith("memory://"):
        from shoal.bus.transport.memory import InMemoryBus, named_broker

        name = url.removeprefix("memory").removeprefix("://") or "default"
        return InMemoryBus(named_broker(name), **options)
    if url.startswith(("nats://", "tls://", "ws://", "wss://")):
        from shoal.bus.transport.nats_bus import NatsBus

        return NatsBus([u.strip() for u in url.split(",") if u.strip()], **options)
    raise ValueError(
        f"unknown bus url {url!r}: use 'memory', 'memory://NAME' or 'nats://HOST:PORT'"
    )


async def connect_bus(url: str = "memory", **options: Any) -> Bus:
    """``make_bus(url, **options)``, connected."""
    bus = make_bus(url, **options)
    await bus.connect()
    return bus
