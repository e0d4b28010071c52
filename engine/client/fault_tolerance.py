"""The engine client's fault-tolerance API (vLLM's ``get_status`` and ``handle_fault``): the
status of every engine core this client knows, and recovery commands sent to all of them.

``status()`` reads the router's liveness table (engine cores known from their heartbeats,
stats and status events): each one's state as vLLM names it (``fault.status_name``), its fault
while UNHEALTHY or DEAD (``PeerLiveness.reason``; one silent past the router's "lost" bound is
``dead``, and says so), and what the last failed command left (``last_ft_request_id``,
``ft_error``). ``apply`` sends a ``FaultToleranceRequest`` to every known engine core at once on
its control subject; a rejection, an error reply or no reply in time is a failed result, and is
recorded (a later success clears the record). ``listeners`` hear each change of an engine core's
status (``observe``, called by the client whenever it hears of an engine core).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from shoal.bus.base import Bus
from shoal.bus.codec import Codec
from shoal.bus.messages.control import ActorState
from shoal.bus.messages.fault import (
    EngineControlReply,
    FaultToleranceRequest,
    FaultToleranceResult,
    status_name,
)
from shoal.bus.runtime.actor import call
from shoal.bus.runtime.liveness import GONE_STATES, LivenessTable
from shoal.bus.subjects import Subjects
from shoal.engine.client.router import EngineRouter

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
FAULTED_STATES = (ActorState.UNHEALTHY, *GONE_STATES)
DEFAULT_COMMAND_TIMEOUT_S = 60.0
_REPLY: Codec[EngineControlReply] = Codec(EngineControlReply)

StatusListener = Callable[[str, str], None]  # (engine id, status name)


class EngineFtStatus(msgspec.Struct, omit_defaults=True):
    """One engine core in ``GET /fault_tolerance/status``; absent fields are left out."""

    id: str
    status: str  # healthy, unhealthy, dead (and shoal's starting, draining)
    fault_info: str | None = None
    last_ft_request_id: str | None = None
    ft_error: str | None = None
    kv_role: str | None = None  # disaggregated prefill: prefill or decode (shoal's own)


class FtStatus(msgspec.Struct):
    """The body of ``GET /fault_tolerance/status`` (vLLM's, ``schema_version`` 1)."""

    schema_version: int
    total_engines: int
    engines: list[EngineFtStatus]


@dataclass(slots=True)
class FailedCommand:
    """The last command an engine core did not carry out."""

    request_id: str
    error: str


def engine_status(
    liveness: LivenessTable,
    engine_id: str,
    *,
    lost_after_s: float,
    failed: FailedCommand | None = None,
    now: float | None = None,
) -> EngineFtStatus:
    """One engine core's entry: its state's name, and its fault while it is faulted (an engine
    core silent for more than ``lost_after_s`` is dead, whatever it said last)."""
    peer = liveness.get(engine_id)
    entry = EngineFtStatus(engine_id, "dead")
    silent = liveness.silent_for(engine_id, now)
    if peer is None or silent is None:
        entry.fault_info = "never heard from"
    elif peer.state not in GONE_STATES and silent > lost_after_s:
        entry.fault_info = f"silent for {silent:.0f} s (last state {status_name(peer.state)})"
    else:
        entry.status = status_name(peer.state)
        if peer.state in FAULTED_STATES and peer.reason:
            entry.fault_info = peer.reason
    if failed is not None:
        entry.last_ft_request_id, entry.ft_error = failed.request_id, failed.error
    return entry


def ft_status(
    liveness: LivenessTable,
    *,
    lost_after_s: float,
    failed: dict[str, FailedCommand] | None = None,
    roles: dict[str, str] | None = None,
    now: float | None = None,
) -> FtStatus:
    """Every engine core the table knows, by id, with its role where its stats gave one."""
    now = time.monotonic() if now is None else now
    failed, roles = failed or {}, roles or {}
    engines = []
    for engine_id in sorted(liveness.peers):
        entry = engine_status(
            liveness, engine_id, lost_after_s=lost_after_s, failed=failed.get(engine_id), now=now
        )
        entry.kv_role = roles.get(engine_id)
        engines.append(entry)
    return FtStatus(SCHEMA_VERSION, len(engines), engines)


class FaultTolerance:
    """Status and recovery commands for the engine cores ``router`` knows."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        router: EngineRouter,
        *,
        command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S,
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.router = router
        self.command_timeout_s = command_timeout_s
        self.failed: dict[str, FailedCommand] = {}
        self.listeners: list[StatusListener] = []
        self._last_status: dict[str, str] = {}

    @property
    def lost_after_s(self) -> float:
        return 2 * self.router.stale_after_s  # the router's own "lost" bound

    def engine_ids(self) -> list[str]:
        return sorted(self.router.liveness.peers)

    def status(self, now: float | None = None) -> FtStatus:
        # (vLLM's body exactly, unless prefill and decode run on separate engine cores)
        roles = {e: view.role for e, view in self.router.engines.items() if view.role != "both"}
        return ft_status(
            self.router.liveness,
            lost_after_s=self.lost_after_s,
            failed=self.failed,
            roles=roles,
            now=now,
        )

    def observe(self, engine_id: str, now: float | None = None) -> None:
        """Tell the listeners if ``engine_id``'s status changed since last observed."""
        status = engine_status(
            self.router.liveness, engine_id, lost_after_s=self.lost_after_s, now=now
        ).status
        if self._last_status.get(engine_id) == status:
            return
        self._last_status[engine_id] = status
        for listener in self.listeners:
            try:
                listener(engine_id, status)
            except Exception:
                log.exception("fault-tolerance status listener failed")

    async def apply(self, request: FaultToleranceRequest) -> dict[str, FaultToleranceResult]:
        """Send ``request`` to every known engine core at once; each one's result."""
        engine_ids = self.engine_ids()
        results = await asyncio.gather(*(self._send(e, request) for e in engine_ids))
        for engine_id, result in zip(engine_ids, results, strict=True):
            if result.success:
                self.failed.pop(engine_id, None)
            else:
                error = result.reason or "failed"
                self.failed[engine_id] = FailedCommand(request.request_id, error)
                log.warning("%s on %s failed: %s", request.instruction, engine_id, error)
        return dict(zip(engine_ids, results, strict=True))

    async def _send(self, engine_id: str, request: FaultToleranceRequest) -> FaultToleranceResult:
        subject = self.subjects.control("engine", engine_id)
        try:
            reply = await call(self.bus, subject, request, _REPLY, timeout=self.command_timeout_s)
        except Exception as exc:  # no responder, timeout, error reply, undecodable reply
            return FaultToleranceResult(request.request_id, False, f"not carried out: {exc!r}")
        if not isinstance(reply, FaultToleranceResult):
            reason = f"unexpected reply {type(reply).__name__}"
            return FaultToleranceResult(request.request_id, False, reason)
        return reply
