"""``NatsBus``: the ``Bus`` on a NATS server through nats-py (the only transport module that
imports ``nats``).

Reconnects by itself (nats-py resubscribes every subscription after the server comes back),
drains on close, chunks payloads above the server's ``max_payload`` (``bus.transport.chunking``).

Several servers (the nodes of a cluster): the client connects to one of them (in random order,
spreading clients over the nodes) and, when that node goes, to another, among those given and
those the cluster advertises (its ``connect_urls``): one node's URL is enough to find the rest.
A node lost without closing its sockets (a host gone) is noticed after ``ping_interval_s`` ×
``max_outstanding_pings`` unanswered pings (about 3 s: within an engine core's
``worker_dead_after_s``, so it reconnects before it would declare its workers dead).

Connected as a user, its reply inboxes are ``Subjects.inbox_prefix(user)`` and its chunked
transfers ``Subjects.transfer_prefix(user)`` (what the user's permissions let it subscribe to,
``bus.nats_ops.permissions``); a publish or subscription the server refuses is counted and logged
(``permission_violations``); refused credentials raise ``BusAuthError``. Server URLs are logged
without their passwords (``bus.nats_ops.credentials``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import ssl
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg as NatsMsg
from nats.aio.subscription import Subscription as NatsSubscription

from shoal.bus.base import Subscription
from shoal.bus.errors import (
    BusClosedError,
    BusError,
    BusTimeoutError,
    ConnectionLostError,
    NoRespondersError,
)
from shoal.bus.msg import Handler, Msg
from shoal.bus.nats_ops.credentials import redact_url
from shoal.bus.subjects import TRANSFER_PREFIX, SubjectError, Subjects, validate_subject
from shoal.bus.transport.chunking import ChunkSender, resolve_chunked
from shoal.bus.transport.dispatch import Dispatcher
from shoal.bus.transport.nats_connected import NatsConnectedBus

if TYPE_CHECKING:
    from shoal.bus.event_stream import EventStream
    from shoal.bus.jetstream.kv_bucket import NatsKvBucket
    from shoal.bus.jetstream.object_store import NatsObjectStore

log = logging.getLogger(__name__)

HEADER_RESERVE = 8 * 1024  # room left for headers when chunking
PENDING_BUFFER = 64 * 1024 * 1024  # outgoing bytes buffered while reconnecting
SUB_PENDING_BYTES = 256 * 1024 * 1024
MAX_KEPT_VIOLATIONS = 100
PERMISSIONS_VIOLATION = "permissions violation"
AUTHORIZATION_VIOLATION = "authorization violation"


class BusAuthError(BusError):
    """The NATS server refused the credentials (wrong user or password, or none given)."""


class _NatsSubscription(Subscription):
    def __init__(self, subject: str, queue: str | None, dispatcher: Dispatcher) -> None:
        self.subject = subject
        self.queue = queue
        self.dispatcher = dispatcher
        self.nats_sub: NatsSubscription | None = None
        self.closed = False

    async def unsubscribe(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.dispatcher.cancel()
        if self.nats_sub is not None:
            with contextlib.suppress(nats.errors.Error):  # closed or draining: nothing to stop
                await self.nats_sub.unsubscribe()

    async def drain(self, timeout: float = 5.0) -> None:
        if self.closed:
            return
        self.closed = True
        if self.nats_sub is not None:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await asyncio.wait_for(self.nats_sub.drain(), timeout)
        await self.dispatcher.drain(timeout)


class NatsBus(NatsConnectedBus):
    """A bus on NATS. Credentials: ``user``/``password``, ``token`` or ``creds_file``; ``tls``
    is an ``ssl.SSLContext`` or True (system defaults). Payloads above ``chunk_size`` (default:
    the server's max_payload less room for headers) travel chunked (``bus.transport.chunking``).
    ``inbox_prefix`` (default: ``_INBOX.<user>`` with a user, else nats-py's ``_INBOX``)."""

    def __init__(
        self,
        servers: list[str] | str = "nats://127.0.0.1:4222",
        *,
        user: str | None = None,
        password: str | None = None,
        token: str | None = None,
        creds_file: str | None = None,
        tls: ssl.SSLContext | bool | None = None,
        tls_hostname: str | None = None,
        name: str | None = None,
        connect_timeout: float = 2.0,
        reconnect_time_wait: float = 0.2,
        max_reconnect_attempts: int = -1,
        ping_interval_s: float = 1.0,
        max_outstanding_pings: int = 2,
        connect_attempts: int = 3,
        drain_timeout: float = 5.0,
        chunk_ttl_s: float = 30.0,
        chunk_size: int | None = None,
        inbox_prefix: str | None = None,
    ) -> None:
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        self.user = user
        self._options: dict[str, Any] = {
            "servers": self.servers,
            "name": name,
            "user": user,
            "password": password,
            "token": token,
            "user_credentials": creds_file,
            "tls": ssl.create_default_context() if tls is True else (tls or None),
            "tls_hostname": tls_hostname,
            "connect_timeout": connect_timeout,
            "reconnect_time_wait": reconnect_time_wait,
            "ping_interval": ping_interval_s,
            "max_outstanding_pings": max_outstanding_pings,
            "drain_timeout": int(max(1, drain_timeout)),
            "pending_size": PENDING_BUFFER,
            "inbox_prefix": inbox_prefix or _user_inbox_prefix(user),
        }
        self.num_permission_violations = 0
        self._auth_refused = False  # the server answered "authorization violation"
        self.permission_violations: collections.deque[str] = collections.deque(
            maxlen=MAX_KEPT_VIOLATIONS
        )  # the server's refusals, latest last
        self._violation_waiters: set[asyncio.Future[str]] = set()
        self._max_reconnect_attempts = max_reconnect_attempts
        self._connect_attempts = connect_attempts
        self._drain_timeout = drain_timeout
        self._chunk_ttl_s = chunk_ttl_s
        self._chunk_size = chunk_size
        self._nc: Client | None = None
        self._subs: set[_NatsSubscription] = set()
        self._chunks: ChunkSender | None = None
        self._waiting: set[asyncio.Task[Any]] = set()  # tasks awaiting a reply in ``request``
        self._cut_off: set[asyncio.Task[Any]] = set()  # of those, cancelled by a lost connection

    @property
    def client(self) -> Client:
        """The nats-py client (for ``bus.jetstream.kv_bucket`` and
        ``bus.jetstream.object_store``)."""
        if self._nc is None:
            raise BusClosedError("NATS bus is not connected")
        return self._nc

    @property
    def is_connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def open_kv(
        self, name: str, *, history: int = 1, ttl_s: float | None = None, replicas: int = 1
    ) -> NatsKvBucket:
        from shoal.bus.buckets import check_bucket_name
        from shoal.bus.jetstream.kv_bucket import NatsKvBucket

        check_bucket_name(name)
        return await NatsKvBucket.open(self, name, history=history, ttl_s=ttl_s, replicas=replicas)

    async def open_object_store(self, name: str, *, replicas: int = 1) -> NatsObjectStore:
        from shoal.bus.buckets import check_bucket_name
        from shoal.bus.jetstream.object_store import NatsObjectStore

        check_bucket_name(name)
        return await NatsObjectStore.open(self, name, replicas=replicas)

    @property
    def connected_url(self) -> str | None:
        """The server this bus is connected to now (``nats://host:port``, no user info)."""
        uri = self._nc.connected_url if self._nc is not None else None
        return f"{uri.scheme}://{uri.hostname}:{uri.port}" if uri is not None else None

    @property
    def max_payload(self) -> int:
        return self.client.max_payload

    async def connect(self) -> None:
        if self._nc is not None:
            return
        options = {k: v for k, v in self._options.items() if v is not None}
        # The first connection gives up after a few attempts (a wrong address or credentials
        # must fail, not hang); once connected, reconnecting follows max_reconnect_attempts.
        options["max_reconnect_attempts"] = self._connect_attempts
        self._auth_refused = False
        try:
            self._nc = await nats.connect(
                error_cb=self._on_error,
                disconnected_cb=self._on_disconnected,
                reconnected_cb=self._on_reconnected,
                **options,
            )
        except (nats.errors.Error, OSError) as exc:
            where = ", ".join(redact_url(u) for u in self.servers)
            if self._auth_refused or _is_auth_error(exc):
                who = f"user {self.user!r}" if self.user else self._credential_kind()
                raise BusAuthError(
                    f"cannot connect to NATS at {where}: it refused the credentials ({who}): "
                    "authorization violation"
                ) from None
            raise BusError(f"cannot connect to NATS at {where}: {exc!r}") from exc
        self._nc.options["max_reconnect_attempts"] = self._max_reconnect_attempts
        chunk_size = max(1024, self._nc.max_payload - HEADER_RESERVE)
        if self._chunk_size is not None:  # smaller chunks: pulled, so flow-controlled
            chunk_size = max(1024, min(chunk_size, self._chunk_size))
        self._chunks = ChunkSender(
            self, chunk_size, ttl_s=self._chunk_ttl_s, prefix=_user_transfer_prefix(self.user)
        )

    def next_violation(self) -> asyncio.Future[str]:
        """A future set to the server's next permissions-violation message (nats-py only
        logs one; the refused request waits for its timeout)."""
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._violation_waiters.add(waiter)
        waiter.add_done_callback(self._violation_waiters.discard)
        return waiter

    def _credential_kind(self) -> str:
        for option, what in (("token", "a token"), ("user_credentials", "a creds file")):
            if self._options.get(option):
                return what
        return "no credentials"

    async def _on_error(self, exc: Exception) -> None:
        if _says(exc, PERMISSIONS_VIOLATION):
            self.num_permission_violations += 1
            self.permission_violations.append(str(exc))
            log.warning("NATS refused (user %r): %s", self.user, exc)
            for waiter in list(self._violation_waiters):
                if not waiter.done():
                    waiter.set_result(str(exc))
            return
        if _is_auth_error(exc):
            if not self._auth_refused:
                log.error("NATS refused the credentials of user %r", self.user)
            self._auth_refused = True
            return
        log.warning("NATS error: %r", exc)

    async def _on_disconnected(self) -> None:
        log.info("NATS disconnected from %s", ", ".join(redact_url(u) for u in self.servers))
        # nats-py keeps waiting for replies that went down with the connection: end each
        # waiting request now (ConnectionLostError) rather than at its timeout.
        for task in self._waiting - self._cut_off:
            self._cut_off.add(task)
            task.cancel()

    async def _on_reconnected(self) -> None:
        self._reconnected()
        log.info("NATS reconnected to %s (%d)", self.connected_url, self.num_reconnects)

    async def close(self) -> None:
        nc = self._nc
        if nc is None:
            return
        subs, self._subs = list(self._subs), set()
        if nc.is_connected:
            await asyncio.gather(*(s.drain(self._drain_timeout) for s in subs))
        for sub in subs:
            sub.dispatcher.cancel()
        if self._chunks is not None:
            self._chunks._held.clear()
        try:
            if nc.is_connected:
                await nc.drain()
            else:
                await nc.close()
        except nats.errors.Error as exc:
            log.debug("NATS close: %r", exc)
            await nc.close()
        self._nc = None

    def new_inbox(self) -> str:
        return self.client.new_inbox()

    async def flush(self, timeout: float = 5.0) -> None:
        nc = self.client
        try:
            # nats-py writes its PING straight to the socket, ahead of commands still in its
            # pending buffer (a SUB just made): push that buffer out first, or the PONG can
            # come back before the server has seen the subscription.
            flush_pending = getattr(nc, "_flush_pending", None)
            if flush_pending is not None and nc.is_connected:
                await asyncio.wait_for(flush_pending(force_flush=True), timeout)
            await nc.flush(timeout=max(1, int(timeout)))
        except (nats.errors.TimeoutError, TimeoutError):
            raise BusTimeoutError(f"flush took longer than {timeout}s") from None
        except nats.errors.ConnectionClosedError:
            raise BusClosedError("NATS connection is closed") from None

    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        reply: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        nc = self.client
        validate_subject(subject)
        if self._chunks is not None:
            data, headers = await self._chunks.wrap(subject, data, headers)
        try:
            await nc.publish(subject, data, reply=reply or "", headers=headers)
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
            raise BusClosedError("NATS connection is closed") from None
        except nats.errors.Error as exc:
            raise BusError(f"publish to {subject!r} failed: {exc!r}") from exc

    async def subscribe(
        self,
        subject: str,
        handler: Handler,
        *,
        queue: str | None = None,
        sequential: bool = False,
    ) -> Subscription:
        nc = self.client
        validate_subject(subject, wildcards=True)
        dispatcher = Dispatcher(
            subject,
            handler,
            sequential=sequential,
            resolve=partial(resolve_chunked, self, timeout=self._drain_timeout),
        )
        sub = _NatsSubscription(subject, queue, dispatcher)
        deliver = dispatcher.deliver

        async def on_message(raw: NatsMsg) -> None:
            deliver(Msg(self, raw.subject, raw.data, raw.reply, raw.headers))

        try:
            sub.nats_sub = await nc.subscribe(
                subject,
                queue=queue or "",
                cb=on_message,
                pending_bytes_limit=SUB_PENDING_BYTES,
            )
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
            dispatcher.cancel()
            raise BusClosedError("NATS connection is closed") from None
        self._subs.add(sub)
        return sub

    async def request(
        self,
        subject: str,
        data: bytes,
        *,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> Msg:
        nc = self.client
        validate_subject(subject)
        if self._chunks is not None:
            data, headers = await self._chunks.wrap(subject, data, headers)
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            raw = await nc.request(subject, data, timeout=timeout, headers=headers)
        except asyncio.CancelledError:
            if task not in self._cut_off:
                raise
            self._cut_off.discard(task)
            task.uncancel()
            raise ConnectionLostError(f"connection lost awaiting a reply on {subject!r}") from None
        except nats.errors.NoRespondersError:
            raise NoRespondersError(f"no responders on {subject!r}") from None
        except nats.errors.TimeoutError:
            raise BusTimeoutError(f"no reply on {subject!r} within {timeout}s") from None
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
            raise BusClosedError("NATS connection is closed") from None
        finally:
            self._waiting.discard(task)
            self._cut_off.discard(task)
        msg = Msg(self, raw.subject, raw.data, raw.reply, raw.headers)
        return await resolve_chunked(self, msg, timeout=timeout)

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
        """A JetStream stream (``bus.jetstream.nats_stream``)."""
        from shoal.bus.jetstream.nats_stream import open_nats_stream

        return await open_nats_stream(
            self,
            name,
            subjects,
            max_age_s=max_age_s,
            max_msgs=max_msgs,
            replicas=replicas,
            max_msgs_per_subject=max_msgs_per_subject,
        )


def _says(exc: BaseException, what: str) -> bool:
    return what in str(exc).lower()


def _user_inbox_prefix(user: str | None) -> str | None:
    """``_INBOX.<user>`` for a user whose name is one subject token, else nats-py's default."""
    if not user:
        return None
    try:
        return Subjects().inbox_prefix(user)
    except SubjectError:
        return None


def _user_transfer_prefix(user: str | None) -> str:
    """``_SHOAL_XFER.<user>`` for a user whose name is one subject token, else ``_SHOAL_XFER``."""
    try:
        return Subjects().transfer_prefix(user) if user else TRANSFER_PREFIX
    except SubjectError:
        return TRANSFER_PREFIX


def _is_auth_error(exc: BaseException) -> bool:
    return isinstance(exc, nats.errors.AuthorizationError) or _says(exc, AUTHORIZATION_VIOLATION)
