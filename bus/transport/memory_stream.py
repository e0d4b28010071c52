"""The in-memory bus's event streams (``InMemoryBus.open_stream``; semantics in
``bus.event_stream``): one store per stream name per ``InMemoryBroker``, fed by the broker's
publish taps, so every bus of that broker (every ``InMemoryBus`` of one in-memory server)
captures into and replays from the same stream, and it outlives the buses that opened it while
the broker lives."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from shoal.bus.base import Bus
from shoal.bus.event_stream import EventStream, StreamFollower, StreamInfo
from shoal.bus.msg import Handler, Msg
from shoal.bus.subjects import tokens_match, validate_subject, validate_token

log = logging.getLogger(__name__)


class TappedBroker(Protocol):
    """What a stream needs of the broker (``bus.transport.memory.InMemoryBroker``): its publish
    taps."""

    @property
    def taps(self) -> list[Callable[[str, bytes, dict[str, str] | None], None]]: ...


@dataclass(frozen=True, slots=True)
class _Stored:
    seq: int
    time: float
    subject: str
    data: bytes
    headers: dict[str, str] | None


class _MemoryFollower(StreamFollower):
    def __init__(self, store: MemoryStreamStore, bus: Bus, handler: Handler) -> None:
        super().__init__()
        self._store = store
        self._bus = bus
        self._handler = handler
        self._queue: asyncio.Queue[_Stored] = asyncio.Queue()
        self._caught_up_at = store.last_seq
        if not store.messages:
            self.caught_up.set()
        for entry in store.messages:
            self._queue.put_nowait(entry)
        store.followers.add(self)
        self._task = asyncio.create_task(self._run(), name=f"follow-{store.name}")

    def push(self, entry: _Stored) -> None:
        self._queue.put_nowait(entry)

    async def _run(self) -> None:
        while True:
            entry = await self._queue.get()
            msg = Msg(self._bus, entry.subject, entry.data, None, entry.headers)
            try:
                await self._handler(msg)
            except Exception:
                log.exception("stream %s: follower's handler failed", self._store.name)
            self.num_delivered += 1
            if entry.seq >= self._caught_up_at:
                self.caught_up.set()

    async def stop(self) -> None:
        self._store.followers.discard(self)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class MemoryStreamStore:
    """The stored messages of one in-memory stream."""

    def __init__(
        self,
        name: str,
        subjects: tuple[str, ...],
        max_age_s: float | None,
        max_msgs: int | None,
        max_msgs_per_subject: int | None = None,
    ) -> None:
        self.name = name
        self.subjects = subjects
        self.patterns = [tuple(subject.split(".")) for subject in subjects]
        self.max_age_s = max_age_s
        self.max_msgs = max_msgs
        self.max_msgs_per_subject = max_msgs_per_subject
        self.counts: dict[str, int] = {}  # stored messages per subject
        self.messages: deque[_Stored] = deque()
        self.last_seq = 0
        self.followers: set[_MemoryFollower] = set()

    def capture(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        tokens = tuple(subject.split("."))
        if not any(tokens_match(pattern, tokens) for pattern in self.patterns):
            return
        self.last_seq += 1
        entry = _Stored(self.last_seq, time.monotonic(), subject, bytes(data), headers)
        self.messages.append(entry)
        self._trim_subject(subject)
        self.trim()
        for follower in self.followers:
            follower.push(entry)

    def _trim_subject(self, subject: str) -> None:
        """Count ``subject``'s new message; drop its oldest beyond ``max_msgs_per_subject``."""
        limit = self.max_msgs_per_subject
        counts = self.counts
        counts[subject] = counts.get(subject, 0) + 1
        if limit is None or counts[subject] <= limit:
            return
        oldest = next(entry for entry in self.messages if entry.subject == subject)
        self.messages.remove(oldest)
        counts[subject] -= 1

    def trim(self) -> None:
        messages = self.messages
        if self.max_msgs is not None:
            while len(messages) > self.max_msgs:
                self._drop_oldest()
        if self.max_age_s is not None:
            oldest = time.monotonic() - self.max_age_s
            while messages and messages[0].time < oldest:
                self._drop_oldest()

    def _drop_oldest(self) -> None:
        self.counts[self.messages.popleft().subject] -= 1

    def clear(self) -> None:
        self.messages.clear()
        self.counts.clear()


_STORES: weakref.WeakKeyDictionary[TappedBroker, dict[str, MemoryStreamStore]] = (
    weakref.WeakKeyDictionary()
)


class MemoryEventStream(EventStream):
    def __init__(self, bus: Bus, store: MemoryStreamStore) -> None:
        self._bus = bus
        self._store = store
        self.name = store.name
        self.subjects = store.subjects

    async def follow(self, handler: Handler) -> StreamFollower:
        self._store.trim()
        return _MemoryFollower(self._store, self._bus, handler)

    async def info(self) -> StreamInfo:
        store = self._store
        store.trim()
        first = store.messages[0].seq if store.messages else 0
        return StreamInfo(store.name, store.subjects, len(store.messages), first, store.last_seq)

    async def purge(self) -> None:
        self._store.clear()


def open_memory_stream(
    bus: Bus,
    broker: TappedBroker,
    name: str,
    subjects: Sequence[str],
    *,
    max_age_s: float | None = None,
    max_msgs: int | None = None,
    max_msgs_per_subject: int | None = None,
) -> MemoryEventStream:
    """The broker's stream ``name``, created (and tapped into its publishes) when missing."""
    validate_token(name, "stream name")
    for subject in subjects:
        validate_subject(subject, wildcards=True)
    stores = _STORES.setdefault(broker, {})
    store = stores.get(name)
    if store is None:
        store = stores[name] = MemoryStreamStore(
            name, tuple(subjects), max_age_s, max_msgs, max_msgs_per_subject
        )
        broker.taps.append(store.capture)
    return MemoryEventStream(bus, store)
