"""Event streams (``Bus.open_stream``): every message published on a set of subjects, stored in
order with bounded retention, replayed to each follower from the start and then live.

On NATS this is a JetStream stream read by an ordered push consumer delivering everything
(``bus.jetstream.nats_stream``); on the in-memory bus, an in-memory stream shared by every bus of
one
broker (``bus.transport.memory_stream``), with the same semantics:

- ``Bus.open_stream(name, subjects, *, max_age_s=None, max_msgs=None, replicas=1,
  max_msgs_per_subject=None)`` creates
  the stream when missing (idempotent: several actors may open it at once; an existing stream
  keeps its configuration) and returns an ``EventStream``.
- ``EventStream.follow(handler)`` calls ``handler(msg)`` for every stored message in order,
  then for each new one, one at a time; ``StreamFollower.caught_up`` is set once every message
  stored when following began has been handled (at once for an empty stream).
- Retention: at most ``max_msgs`` messages, at most ``max_msgs_per_subject`` of each subject,
  none older than ``max_age_s`` (oldest dropped first); ``purge`` drops them all. Messages are
  stored as they travel (a follower sees ``Msg.subject``, ``data`` and ``headers``; no reply
  subject): one above the bus's payload limit is stored as its chunking stand-in, whose chunks
  are not kept, so publishers on a stream keep their messages under the limit.
- Errors (a stream deleted, JetStream unavailable) are ``BusError``.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass

from shoal.bus.msg import Handler


@dataclass(frozen=True, slots=True)
class StreamInfo:
    name: str
    subjects: tuple[str, ...]
    num_msgs: int
    first_seq: int  # 0 when empty
    last_seq: int  # the last sequence ever stored (0: none yet)


class StreamFollower(abc.ABC):
    """One follower of a stream. ``stop`` ends delivery (idempotent)."""

    def __init__(self) -> None:
        self.caught_up = asyncio.Event()
        self.num_delivered = 0

    @abc.abstractmethod
    async def stop(self) -> None: ...


class EventStream(abc.ABC):
    """A stream opened through ``Bus.open_stream``."""

    name: str
    subjects: tuple[str, ...]

    @abc.abstractmethod
    async def follow(self, handler: Handler) -> StreamFollower:
        """Deliver every stored message in order, then the live ones (see the module doc)."""

    @abc.abstractmethod
    async def info(self) -> StreamInfo: ...

    @abc.abstractmethod
    async def purge(self) -> None:
        """Drop every stored message (followers keep following new ones)."""
