"""Event streams (``Bus.open_stream``): every message published on a set of subjects, stored in
order with bounded retention, replayed to each follower from the start and then live.

On NATS this is a JetStream stream read by an ordered push consumer delivering everything
(``bus.nats_stream``); on the in-memory bus, an in-memory stream shared by every bus of one
broker (``bus.memory_stream``), with the same semantics:

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

from shoal.bus.base import Bus, Handler
from shoal.bus.subjects import Subjects


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


# The prefix-routing stream: engine cores publish about one batch per busy step and a full
# snapshot every snapshot interval, KV tiers a batch per short moment that changed them and a
# snapshot as often; a client replays what is left of it on start. Retention is per source (one
# subject each), so a busy one cannot push another's snapshot out, and a few snapshot intervals
# long: older batches are superseded by a later snapshot.
KV_EVENTS_MAX_MSGS_PER_ENGINE = 20_000
KV_EVENTS_SNAPSHOTS_KEPT = 4


def kv_events_subjects(subjects: Subjects) -> list[str]:
    """What the kv-events stream captures."""
    return [subjects.kv_events("*"), subjects.tier_kv_events("*")]


async def open_kv_events_stream(
    bus: Bus, subjects: Subjects, replicas: int = 1, snapshot_interval_s: float = 30.0
) -> EventStream:
    """The stream of every engine core's and KV tier's KV events (opened by them and clients;
    the first to create it sets its retention and subjects: ``shoal nats-init`` adds those
    missing from an older one)."""
    return await bus.open_stream(
        subjects.kv_events_stream(),
        kv_events_subjects(subjects),
        max_age_s=KV_EVENTS_SNAPSHOTS_KEPT * snapshot_interval_s,
        max_msgs_per_subject=KV_EVENTS_MAX_MSGS_PER_ENGINE,
        replicas=replicas,
    )
