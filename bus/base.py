"""The ``Bus`` interface every shoal actor talks through (its message type: ``bus.msg``; its
errors: ``bus.errors``), and the responder's side of the streamed-reply protocol shared by both
transports (the caller's: ``bus.streams``).

Semantics (identical on ``InMemoryBus`` and ``NatsBus``; ``tests/actors/test_bus_contract.py``):

- Subjects are dot-separated tokens; subscriptions may use ``*`` (one token) and ``>`` (the rest).
- A handler runs as its own task, so a slow handler never blocks delivery. Handlers of one
  subscription *start* in arrival order; pass ``sequential=True`` to ``subscribe`` to run them one
  at a time in arrival order instead.
- ``queue=`` groups: each message goes to one member of the group.
- ``request`` raises ``NoRespondersError`` at once when nobody listens, ``BusTimeoutError`` when
  nobody answers in time, ``ConnectionLostError`` at once when the connection drops while it
  waits (the reply could be lost with it).
- A transport that reconnects by itself (NATS) counts ``num_reconnects`` and calls the
  ``on_reconnect`` listeners: what was in flight across the loss may be gone.
- Streamed replies: the responder sends any number of chunks then one final message or an error
  (``ReplyStream``); the caller iterates ``bus.streams.request_stream``.
- Payloads larger than the transport's ``max_payload`` are chunked and reassembled transparently.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shoal.bus.errors import BusError
from shoal.bus.msg import Handler, Msg

if TYPE_CHECKING:
    from shoal.bus.buckets import KvBucket, ObjectStore
    from shoal.bus.event_stream import EventStream

log = logging.getLogger(__name__)

# Header carrying the streamed-reply protocol; values below.
STREAM_HEADER = "Shoal-Stream"
STREAM_MORE = "more"  # a chunk; more follow
STREAM_LAST = "last"  # the final chunk, carries data
STREAM_END = "end"  # end of stream, no data (not yielded to the caller)
STREAM_ERROR = "error"  # the stream failed; data is the UTF-8 message, code in ERROR_CODE_HEADER
ERROR_CODE_HEADER = "Shoal-Error"


class Subscription(abc.ABC):
    """A live subscription. ``unsubscribe`` stops delivery at once and cancels running
    handlers; ``drain`` stops delivery and lets queued and running handlers finish (bounded)."""

    subject: str
    queue: str | None

    @abc.abstractmethod
    async def unsubscribe(self) -> None: ...

    async def drain(self, timeout: float = 5.0) -> None:
        await self.unsubscribe()


class Bus(abc.ABC):
    """A message bus: publish/subscribe, queue groups, request/reply, streamed replies."""

    num_reconnects: int = 0  # connections re-established after a loss
    _reconnect_listeners: tuple[Callable[[], None], ...] = ()

    def on_reconnect(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` whenever the connection is back after a loss; returns the
        function that removes it."""
        self._reconnect_listeners = (*self._reconnect_listeners, listener)

        def remove() -> None:
            self._reconnect_listeners = tuple(
                each for each in self._reconnect_listeners if each is not listener
            )

        return remove

    def _reconnected(self) -> None:
        """For transports: count a reconnect and tell the listeners."""
        self.num_reconnects += 1
        for listener in self._reconnect_listeners:
            try:
                listener()
            except Exception:
                log.exception("reconnect listener failed")

    @abc.abstractmethod
    async def connect(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Drain: stop taking messages, let running handlers finish, flush, disconnect."""

    @property
    @abc.abstractmethod
    def is_connected(self) -> bool: ...

    @abc.abstractmethod
    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        reply: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None: ...

    @abc.abstractmethod
    async def subscribe(
        self,
        subject: str,
        handler: Handler,
        *,
        queue: str | None = None,
        sequential: bool = False,
    ) -> Subscription: ...

    @abc.abstractmethod
    async def request(
        self,
        subject: str,
        data: bytes,
        *,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> Msg: ...

    @abc.abstractmethod
    def new_inbox(self) -> str: ...

    @abc.abstractmethod
    async def flush(self, timeout: float = 5.0) -> None:
        """Return once everything published so far has reached the transport."""

    @abc.abstractmethod
    async def open_kv(
        self, name: str, *, history: int = 1, ttl_s: float | None = None, replicas: int = 1
    ) -> KvBucket:
        """Key-value bucket ``name`` (``bus.buckets``), created when missing with ``history``
        revisions per key, entries expiring after ``ttl_s`` (None: never) and ``replicas``
        copies in a NATS cluster (ignored in memory); a bucket that exists keeps its own."""

    @abc.abstractmethod
    async def open_object_store(self, name: str, *, replicas: int = 1) -> ObjectStore:
        """Object store ``name`` (``bus.buckets``), created when missing (``replicas`` as for
        ``open_kv``)."""

    @abc.abstractmethod
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
        """Open (creating when missing) the event stream ``name`` capturing ``subjects``
        (``bus.event_stream``)."""

    async def __aenter__(self) -> Bus:
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class ReplyStream:
    """The responder's side of a streamed reply to ``msg``: ``send`` chunks, then ``end`` or
    ``error`` exactly once."""

    __slots__ = ("_msg", "closed")

    def __init__(self, msg: Msg) -> None:
        if not msg.reply:
            raise BusError(f"message on {msg.subject!r} has no reply subject to stream to")
        self._msg = msg
        self.closed = False

    async def send(self, data: bytes) -> None:
        await self._publish(data, STREAM_MORE, close=False)

    async def end(self, data: bytes | None = None) -> None:
        """Finish the stream; ``data`` (if given) is the last message the caller receives."""
        if data is None:
            await self._publish(b"", STREAM_END, close=True)
        else:
            await self._publish(data, STREAM_LAST, close=True)

    async def error(self, message: str, code: str = "error") -> None:
        await self._publish(
            message.encode(), STREAM_ERROR, close=True, extra={ERROR_CODE_HEADER: code}
        )

    async def _publish(
        self, data: bytes, kind: str, *, close: bool, extra: dict[str, str] | None = None
    ) -> None:
        if self.closed:
            raise BusError("reply stream already ended")
        self.closed = close
        headers = {STREAM_HEADER: kind}
        if extra:
            headers.update(extra)
        await self._msg.respond(data, headers=headers)
