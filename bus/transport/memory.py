"""``InMemoryBus``: the bus inside one process, with NATS's semantics (wildcards, queue groups,
request/reply with "no responders", streamed replies, chunking above an optional max_payload).

Buses on one ``InMemoryBroker`` see each other's messages and share its key-value buckets and
object stores (``bus.transport.memory_jetstream``); each bus closes on its own. Used by the
offline API, local single-process mode and fast tests.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import uuid
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

from shoal.bus.base import Bus, Subscription
from shoal.bus.errors import BusClosedError, BusError, BusTimeoutError, NoRespondersError
from shoal.bus.msg import Handler, Msg
from shoal.bus.streams import NO_RESPONDERS_STATUS, STATUS_HEADER, is_no_responders
from shoal.bus.subjects import tokens_match, validate_subject
from shoal.bus.transport.chunking import ChunkSender, resolve_chunked
from shoal.bus.transport.dispatch import Dispatcher

if TYPE_CHECKING:
    from shoal.bus.event_stream import EventStream
    from shoal.bus.transport.memory_jetstream import MemoryKvBucket, MemoryObjectStore


class _MemorySubscription(Subscription):
    def __init__(
        self, bus: InMemoryBus, subject: str, queue: str | None, dispatcher: Dispatcher
    ) -> None:
        self.bus = bus
        self.subject = subject
        self.queue = queue
        self.pattern = tuple(subject.split("."))
        self.dispatcher = dispatcher

    async def unsubscribe(self) -> None:
        self.bus._broker.remove(self)
        self.bus._subs.discard(self)
        self.dispatcher.cancel()

    async def drain(self, timeout: float = 5.0) -> None:
        self.bus._broker.remove(self)
        self.bus._subs.discard(self)
        await self.dispatcher.drain(timeout)


class InMemoryBroker:
    """The shared subject space of a set of in-memory buses."""

    def __init__(self) -> None:
        self._subs: list[_MemorySubscription] = []
        self._cache: dict[str, list[_MemorySubscription]] = {}
        self._round_robin = itertools.count(random.randrange(1 << 16))
        # Called with every publish (subject, data, headers): the streams' captures.
        self.taps: list[Callable[[str, bytes, dict[str, str] | None], None]] = []

    def add(self, sub: _MemorySubscription) -> None:
        self._subs.append(sub)
        self._cache.clear()

    def remove(self, sub: _MemorySubscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)
            self._cache.clear()

    def route(self, subject: str) -> list[_MemorySubscription]:
        """Every plain subscriber, plus one member of each matching queue group."""
        matching = self._cache.get(subject)
        if matching is None:
            tokens = tuple(subject.split("."))
            matching = [s for s in self._subs if tokens_match(s.pattern, tokens)]
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[subject] = matching
        if not any(s.queue for s in matching):
            return matching
        targets = [s for s in matching if s.queue is None]
        groups: dict[str, list[_MemorySubscription]] = {}
        for s in matching:
            if s.queue is not None:
                groups.setdefault(s.queue, []).append(s)
        turn = next(self._round_robin)
        targets.extend(members[turn % len(members)] for members in groups.values())
        return targets


# Weak: a named broker lives as long as some bus uses it (no leak per offline LLM instance).
_NAMED_BROKERS: weakref.WeakValueDictionary[str, InMemoryBroker] = weakref.WeakValueDictionary()


def named_broker(name: str) -> InMemoryBroker:
    """The process-wide broker of that name (``connect_bus("memory://name")``)."""
    broker = _NAMED_BROKERS.get(name)
    if broker is None:
        broker = _NAMED_BROKERS[name] = InMemoryBroker()
    return broker


class InMemoryBus(Bus):
    """A bus in this process. ``max_payload`` (None: unlimited) enables chunking like NATS."""

    def __init__(
        self,
        broker: InMemoryBroker | None = None,
        *,
        max_payload: int | None = None,
        drain_timeout: float = 5.0,
    ) -> None:
        self._broker = broker if broker is not None else InMemoryBroker()
        self.max_payload = max_payload
        self._drain_timeout = drain_timeout
        self._connected = False
        self._subs: set[_MemorySubscription] = set()
        self._inbox_prefix = f"_INBOX.{uuid.uuid4().hex}"
        self._inbox_ids = itertools.count()
        self._chunks = ChunkSender(self, max_payload) if max_payload else None
        self._reply_prefix = f"{self._inbox_prefix}.r"  # one subscription for every request
        self._reply_sub: Subscription | None = None
        self._pending_replies: dict[str, asyncio.Future[Msg]] = {}

    @property
    def broker(self) -> InMemoryBroker:
        return self._broker

    def sibling(self, **kwargs: object) -> InMemoryBus:
        """Another bus on the same broker (e.g. one per actor)."""
        return InMemoryBus(self._broker, max_payload=self.max_payload, **kwargs)  # type: ignore[arg-type]

    @property
    def is_connected(self) -> bool:
        return self._connected

    async def connect(self) -> None:
        self._connected = True

    async def close(self) -> None:
        if not self._connected:
            return
        for sub in list(self._subs):
            self._broker.remove(sub)
        await asyncio.gather(*(s.dispatcher.drain(self._drain_timeout) for s in self._subs))
        self._subs.clear()
        self._reply_sub = None
        if self._chunks is not None:
            await self._chunks.close()
        self._connected = False

    def new_inbox(self) -> str:
        return f"{self._inbox_prefix}.{next(self._inbox_ids)}"

    async def open_kv(
        self, name: str, *, history: int = 1, ttl_s: float | None = None, replicas: int = 1
    ) -> MemoryKvBucket:
        """The broker's bucket ``name``, shared by its buses (``replicas`` ignored)."""
        from shoal.bus.buckets import check_bucket_name
        from shoal.bus.transport.memory_jetstream import MemoryKvBucket

        self._check_open()
        check_bucket_name(name)
        return MemoryKvBucket.open(self, self._broker, name, history=history, ttl_s=ttl_s)

    async def open_object_store(self, name: str, *, replicas: int = 1) -> MemoryObjectStore:
        """The broker's object store ``name``, shared by its buses (``replicas`` ignored)."""
        from shoal.bus.buckets import check_bucket_name
        from shoal.bus.transport.memory_jetstream import MemoryObjectStore

        self._check_open()
        check_bucket_name(name)
        return MemoryObjectStore.open(self, self._broker, name)

    async def flush(self, timeout: float = 5.0) -> None:
        self._check_open()
        await asyncio.sleep(0)

    def _check_open(self) -> None:
        if not self._connected:
            raise BusClosedError("in-memory bus is not connected")

    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        reply: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._check_open()
        validate_subject(subject)
        if self._chunks is not None:
            data, headers = await self._chunks.wrap(subject, data, headers)
        for tap in self._broker.taps:  # what travels, as a JetStream stream stores it
            tap(subject, data, headers)
        self._deliver(subject, bytes(data), reply, headers)

    def _deliver(
        self, subject: str, data: bytes, reply: str | None, headers: dict[str, str] | None
    ) -> None:
        targets = self._broker.route(subject)
        if not targets and reply:
            status = {STATUS_HEADER: NO_RESPONDERS_STATUS}
            for sub in self._broker.route(reply):
                sub.dispatcher.deliver(Msg(sub.bus, reply, b"", None, status))
            return
        for sub in targets:
            copied = dict(headers) if headers else None
            sub.dispatcher.deliver(Msg(sub.bus, subject, data, reply, copied))

    async def subscribe(
        self,
        subject: str,
        handler: Handler,
        *,
        queue: str | None = None,
        sequential: bool = False,
    ) -> Subscription:
        self._check_open()
        validate_subject(subject, wildcards=True)
        dispatcher = Dispatcher(
            subject,
            handler,
            sequential=sequential,
            resolve=partial(resolve_chunked, self, timeout=self._drain_timeout),
        )
        sub = _MemorySubscription(self, subject, queue, dispatcher)
        self._subs.add(sub)
        self._broker.add(sub)
        return sub

    async def _take_reply(self, msg: Msg) -> None:
        reply = self._pending_replies.get(msg.subject)
        if reply is not None and not reply.done():
            reply.set_result(msg)

    async def request(
        self,
        subject: str,
        data: bytes,
        *,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> Msg:
        self._check_open()
        if self._reply_sub is None:
            pattern = f"{self._reply_prefix}.*"
            self._reply_sub = await self.subscribe(pattern, self._take_reply)
        reply: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        inbox = f"{self._reply_prefix}.{next(self._inbox_ids)}"
        self._pending_replies[inbox] = reply
        try:
            await self.publish(subject, data, reply=inbox, headers=headers)
            msg = await asyncio.wait_for(reply, timeout)
        except TimeoutError:
            raise BusTimeoutError(f"no reply on {subject!r} within {timeout}s") from None
        finally:
            self._pending_replies.pop(inbox, None)
        if is_no_responders(msg):
            raise NoRespondersError(f"no responders on {subject!r}")
        return msg

    async def open_stream(
        self,
        name: str,
        subjects: Sequence[str],
        *,
        max_age_s: float | None = None,
        max_msgs: int | None = None,
        replicas: int = 1,
        max_msgs_per_subject: int | None = None,
    ) -> EventStream:
        """This broker's stream ``name`` (``bus.transport.memory_stream``; ``replicas`` has no
        meaning in one process)."""
        from shoal.bus.transport.memory_stream import open_memory_stream

        self._check_open()
        return open_memory_stream(
            self,
            self._broker,
            name,
            subjects,
            max_age_s=max_age_s,
            max_msgs=max_msgs,
            max_msgs_per_subject=max_msgs_per_subject,
        )


__all__ = ["BusError", "InMemoryBroker", "InMemoryBus", "named_broker"]
