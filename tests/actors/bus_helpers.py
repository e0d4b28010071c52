"""Messages and a small actor for the bus tests (importable by the actor subprocess)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

import msgspec

from shoal.bus.base import Bus, ReplyStream
from shoal.bus.codec import Codec
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import Actor, Inbox


class Ping(msgspec.Struct, tag="ping", array_like=True):
    seq: int
    delay_s: float = 0.0


class Count(msgspec.Struct, tag="count", array_like=True):
    n: int


class Note(msgspec.Struct, tag="note", array_like=True):
    text: str


class Pong(msgspec.Struct, tag="pong", array_like=True):
    seq: int
    pid: int
    actor_id: str


EchoInbound = Ping | Count
EchoEvents = Note
PONG_CODEC: Codec[Pong] = Codec(Pong)


class EchoActor(Actor):
    """Answers ``Ping`` with ``Pong`` (after ``delay_s``), streams ``Count`` as n pongs, and
    records ``Note`` events."""

    kind = "echo"

    def __init__(self, bus: Bus, actor_id: str, **options: float) -> None:
        super().__init__(bus, actor_id, **options)  # type: ignore[arg-type]
        self.notes: list[str] = []
        self.inflight = 0

    def request_subject(self) -> str:
        return self.subjects.control(self.kind, self.actor_id)

    def event_subject(self) -> str:
        return f"{self.subjects.namespace}.test.echo.{self.actor_id}.notes"  # a test's own

    def inboxes(self) -> Sequence[Inbox]:
        return [
            Inbox(self.request_subject(), self.on_request, Codec(EchoInbound)),
            Inbox(self.event_subject(), self.on_note, Codec(EchoEvents)),
        ]

    async def on_request(self, request: Ping | Count, msg: Msg) -> Pong | None:
        match request:
            case Ping(seq=seq, delay_s=delay_s):
                self.inflight += 1
                try:
                    await asyncio.sleep(delay_s)
                finally:
                    self.inflight -= 1
                return Pong(seq, os.getpid(), self.actor_id)
            case Count(n=n):
                stream = ReplyStream(msg)
                for i in range(n):
                    await stream.send(PONG_CODEC.encode(Pong(i, os.getpid(), self.actor_id)))
                await stream.end()
                return None

    async def on_note(self, note: Note, msg: Msg) -> None:
        self.notes.append(note.text)

    def load(self) -> dict[str, float]:
        return {"inflight": float(self.inflight)}
