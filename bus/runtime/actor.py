"""The actor base: declared inboxes with typed handlers, start/stop with drain, a periodic
heartbeat, status events, and ``run_forever`` with graceful drain on SIGTERM/SIGINT.

The same class runs as a task in a shared event loop (``asyncio.create_task(actor.run_forever(
install_signals=False))``, stopped by ``actor.request_stop()``) or as its own OS process
(``python -m shoal.bus.runtime.run_actor``, usually started by
``bus.runtime.supervisor.Supervisor``).

A handler receives the decoded message and the raw ``Msg``. For a request, a returned struct (or
bytes) is the reply; an undecodable payload or a failing handler gets an ``ErrorReply`` (flagged
with the ``Shoal-Error`` header); for an event, it is logged and counted. The actor keeps running.

Heartbeats and status events carry the actor's ``incarnation``, fixed when the actor object is
made: a restarted actor keeps its id but not its incarnation, so peers (``bus.runtime.liveness``)
know that what the old one held is lost. An actor whose peers must also learn that messages in
flight across a lost bus connection may be gone (an engine core's clients: an add or an output)
takes a new incarnation at each reconnect too (``new_incarnation_on_reconnect``).

Every actor also serves ``RestartActor`` on ``subjects.restart(kind, id)`` (``shoal restart``):
one that runs as its own process answers ``RestartAccepted``, drains as on SIGTERM and exits
with ``EXIT_RESTART_REQUESTED``, so its supervisor starts a new incarnation; one that shares a
process with others refuses (nothing would start it again).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from shoal.bus.base import ERROR_CODE_HEADER, Bus, Subscription
from shoal.bus.codec import Codec, DecodeError, encode
from shoal.bus.errors import BusError
from shoal.bus.messages.control import (
    ActorState,
    ErrorReply,
    Heartbeat,
    RestartAccepted,
    RestartActor,
    StatusEvent,
)
from shoal.bus.msg import Msg
from shoal.bus.streams import error_from_reply
from shoal.bus.subjects import Subjects, validate_token

log = logging.getLogger(__name__)
HOST = socket.gethostname()  # told with every heartbeat (shoal status)

TypedHandler = Callable[[Any, Msg], Awaitable[Any]]
# The exit code of an actor that took a ``RestartActor``: non-zero, so that every supervisor
# (shoal's, Kubernetes', Docker's ``on-failure``) starts it again.
EXIT_RESTART_REQUESTED = 75
_RESTART: Codec[RestartActor] = Codec(RestartActor)


def new_incarnation() -> str:
    """An id for one life of an actor: its process id and a random token (unique even when a
    restarted process is given the same pid, or several actors share a process)."""
    return f"{os.getpid()}-{secrets.token_hex(6)}"


@dataclass(frozen=True)
class Inbox:
    """One subscription of an actor: messages on ``subject`` decoded by ``codec`` (None: the
    handler gets the raw bytes) and passed to ``handler(obj, msg)``."""

    subject: str
    handler: TypedHandler
    codec: Codec[Any] | None = None
    queue: str | None = None
    sequential: bool = False


class Actor:
    """Base of every shoal actor. Override ``inboxes``, and optionally ``on_start``,
    ``on_stop`` and ``load``."""

    kind: ClassVar[str] = "actor"
    new_incarnation_on_reconnect: ClassVar[bool] = False

    def __init__(
        self,
        bus: Bus,
        actor_id: str,
        *,
        namespace: str = "shoal",
        heartbeat_interval_s: float = 1.0,
        drain_timeout_s: float = 5.0,
    ) -> None:
        self.bus = bus
        self.actor_id = validate_token(actor_id, "actor id")
        validate_token(self.kind, "actor kind")
        self.subjects = Subjects(namespace)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.drain_timeout_s = drain_timeout_s
        self.owns_bus = False  # close the bus on stop (set when the actor runs as a process)
        self.exit_code = 0  # of its process, once ``run_forever`` returns (non-zero: restart me)
        self.state = ActorState.STARTING
        self._life = new_incarnation()
        self.started_at = time.time()  # this life's start, told with every heartbeat
        self.num_decode_errors = 0
        self.num_handler_errors = 0
        self._heartbeat_seq = 0
        self._subscriptions: list[Subscription] = []
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._stop_requested: asyncio.Event | None = None

    @property
    def incarnation(self) -> str:
        """Sent with every heartbeat and status event: this life of the actor (and, with
        ``new_incarnation_on_reconnect``, this connection of it)."""
        if self.new_incarnation_on_reconnect and self.bus.num_reconnects:
            return f"{self._life}.{self.bus.num_reconnects}"
        return self._life

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind}/{self.actor_id}, {self.state.name})"

    # -- to override ---------------------------------------------------------------------------
    def inboxes(self) -> Sequence[Inbox]:
        return ()

    async def on_start(self) -> None:
        """Before the inboxes are subscribed."""

    async def on_stop(self) -> None:
        """After the inboxes are drained."""

    def load(self) -> dict[str, float]:
        """Load figures sent with every heartbeat."""
        return {}

    def served_engine(self) -> str:
        """The engine core whose service needs this actor ("" for none), told with every
        heartbeat: ``shoal restart`` keeps one engine core serving."""
        return ""

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if not self.bus.is_connected:
            await self.bus.connect()
        await self.on_start()
        restart = Inbox(self.subjects.restart(self.kind, self.actor_id), self._on_restart, _RESTART)
        for inbox in (*self.inboxes(), restart):
            sub = await self.bus.subscribe(
                inbox.subject,
                self._make_handler(inbox),
                queue=inbox.queue,
                sequential=inbox.sequential,
            )
            self._subscriptions.append(sub)
        await self.bus.flush()
        if self.owns_bus:
            # This process is the actor's own: what start-up made (an engine core's block
            # pool, a worker's model) lives as long as it, so keep it out of every later
            # collection, as vLLM does; a full collection then pauses for newer objects only.
            gc.collect()
            gc.freeze()
        await self.set_state(ActorState.READY, "started")
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop())

    async def stop(self, reason: str = "stopped") -> None:
        """Stop taking messages, let running handlers finish, then stop (idempotent)."""
        if self.state in (ActorState.DRAINING, ActorState.STOPPED):
            return
        await self.set_state(ActorState.DRAINING, reason)
        subs, self._subscriptions = self._subscriptions, []
        await asyncio.gather(*(s.drain(self.drain_timeout_s) for s in subs))
        heartbeat, self._heartbeat_task = self._heartbeat_task, None
        if heartbeat is not None:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
        try:
            await self.on_stop()
        finally:
            await self.set_state(ActorState.STOPPED, reason)
            if self.owns_bus:
                await self.bus.close()
                gc.unfreeze()  # collectable again by the collection at interpreter exit

    def request_stop(self) -> None:
        """Ask ``run_forever`` to drain and return (safe from a signal handler)."""
        if self._stop_requested is not None:
            self._stop_requested.set()

    async def exit_for_restart(self, exit_code: int) -> None:
        """End this actor's process with ``exit_code`` (non-zero: its supervisor restarts it):
        ``run_forever`` drains and returns; the caller is cancelled by the stop."""
        self.exit_code = exit_code
        self.request_stop()
        await asyncio.Event().wait()

    async def _on_restart(self, command: RestartActor, msg: Msg) -> RestartAccepted | None:
        if not self.owns_bus:
            await self._reply_error(
                msg, "refused", f"{self.kind} {self.actor_id} shares its process: nothing would "
                "start it again"
            )  # fmt: skip
            return None
        log.warning("%r: restart requested (%s)", self, command.reason or "no reason given")
        self.exit_code = EXIT_RESTART_REQUESTED
        asyncio.get_running_loop().call_soon(self.request_stop)  # after the answer is sent
        return RestartAccepted(self.actor_id, self.kind, self.incarnation)

    def begin_new_life(self) -> None:
        """Restart in place: a new incarnation, as peers see a new process."""
        self._life = new_incarnation()

    async def run_forever(self, *, install_signals: bool = True) -> None:
        """Start, serve until ``request_stop`` (or SIGTERM/SIGINT), then drain and stop."""
        self._stop_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)
        install = install_signals and threading.current_thread() is threading.main_thread()
        if install:
            for signum in signals:
                loop.add_signal_handler(signum, self.request_stop)
        try:
            await self.start()
            await self._stop_requested.wait()
            await self.stop("stop requested")
        finally:
            if install:
                for signum in signals:
                    loop.remove_signal_handler(signum)

    # -- messages ------------------------------------------------------------------------------
    def _make_handler(self, inbox: Inbox) -> Callable[[Msg], Awaitable[None]]:
        codec, handler = inbox.codec, inbox.handler

        async def handle(msg: Msg) -> None:
            try:
                obj = codec.decode(msg.data) if codec is not None else msg.data
            except DecodeError as exc:
                self.num_decode_errors += 1
                log.warning("%r: undecodable message on %s: %s", self, msg.subject, exc)
                await self._reply_error(msg, "undecodable", str(exc))
                return
            try:
                result = await handler(obj, msg)
            except Exception as exc:
                self.num_handler_errors += 1
                log.exception("%r: handler for %s failed", self, msg.subject)
                await self._reply_error(msg, "internal", f"{type(exc).__name__}: {exc}")
                return
            if result is not None and msg.reply:
                data = result if isinstance(result, bytes | bytearray) else encode(result)
                await msg.respond(bytes(data))

        return handle

    async def _reply_error(self, msg: Msg, code: str, message: str) -> None:
        if not msg.reply:
            return
        try:
            await msg.respond(encode(ErrorReply(code, message)), headers={ERROR_CODE_HEADER: code})
        except BusError as exc:
            log.warning("%r: could not send error reply: %r", self, exc)

    # -- health --------------------------------------------------------------------------------
    async def set_state(self, state: ActorState, reason: str = "") -> None:
        """Change state and publish a ``StatusEvent`` (best effort)."""
        self.state = state
        event = StatusEvent(self.actor_id, self.kind, state, time.time(), reason, self.incarnation)
        try:
            await self.bus.publish(self.subjects.status(self.kind), encode(event))
        except BusError as exc:
            log.debug("%r: status not published: %r", self, exc)

    def make_heartbeat(self) -> Heartbeat:
        self._heartbeat_seq += 1
        return Heartbeat(
            self.actor_id,
            self.kind,
            self._heartbeat_seq,
            self.state,
            time.time(),
            self.load(),
            self.incarnation,
            HOST,
            self.started_at,
            self.served_engine(),
        )

    async def _heartbeat_loop(self) -> None:
        subject = self.subjects.heartbeat(self.kind)
        while True:
            try:
                await self.bus.publish(subject, encode(self.make_heartbeat()))
            except BusError as exc:
                log.debug("%r: heartbeat not published: %r", self, exc)
            except Exception:
                log.exception("%r: heartbeat failed", self)
            await asyncio.sleep(self.heartbeat_interval_s)


async def call(
    bus: Bus,
    subject: str,
    request: Any,
    reply_codec: Codec[Any],
    *,
    timeout: float,
) -> Any:
    """Typed request/reply: encode ``request``, wait for the reply and decode it with
    ``reply_codec``. Raises ``RemoteError`` when the responder sent an ``ErrorReply``."""
    reply = await bus.request(subject, encode(request), timeout=timeout)
    if reply.header(ERROR_CODE_HEADER):
        raise error_from_reply(reply)
    return reply_codec.decode(reply.data)
