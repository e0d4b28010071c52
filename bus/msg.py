"""``Msg``, one received message (its ``respond`` publishes to its reply subject through the bus
it came from), and ``Handler``, what a subscription calls with each."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from shoal.bus.errors import BusClosedError, BusError


class Publisher(Protocol):
    """What a message needs of its bus (``bus.base.Bus``) to answer."""

    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        reply: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None: ...


class Msg:
    """One received message. ``respond`` publishes to its reply subject."""

    __slots__ = ("_bus", "data", "headers", "reply", "subject")

    def __init__(
        self,
        bus: Publisher | None,
        subject: str,
        data: bytes,
        reply: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._bus = bus
        self.subject = subject
        self.data = data
        self.reply = reply or None
        self.headers = headers or None

    async def respond(self, data: bytes, *, headers: dict[str, str] | None = None) -> None:
        if not self.reply:
            raise BusError(f"message on {self.subject!r} has no reply subject")
        if self._bus is None:
            raise BusClosedError("message is not bound to a bus")
        await self._bus.publish(self.reply, data, headers=headers)

    def header(self, name: str) -> str | None:
        return self.headers.get(name) if self.headers else None

    def __repr__(self) -> str:
        return f"Msg(subject={self.subject!r}, reply={self.reply!r}, {len(self.data)} bytes)"


Handler = Callable[[Msg], Awaitable[None]]
