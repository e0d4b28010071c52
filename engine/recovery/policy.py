"""The recovery policy: when to send ``retry`` to which engine core, as a pure state machine.

Fed with what the bus shows of each engine core (its state from heartbeats and status events,
its incarnation) and with the results of the retries it asked for, ``poll(now)`` returns the
decisions to carry out: send a retry, or give up. A fault opens when an engine core reports
UNHEALTHY or DEAD and closes when it is READY again (a successful retry says so too) or a new
incarnation of it appears; retries are counted per fault. UNHEALTHY: retry at once, then after
each failure wait ``backoff_s`` doubling up to ``max_backoff_s``; after ``max_retries`` failed
retries give up (once per fault). DEAD: wait; the engine core turns UNHEALTHY by itself once its
workers are back. Nothing here survives a restart, and nothing needs to: a fresh policy that
sees an UNHEALTHY heartbeat opens the fault and retries. No I/O; every method takes ``now``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shoal.bus.messages.control import ActorState
from shoal.config.deployment import FaultToleranceConfig

FAULTED = (ActorState.UNHEALTHY, ActorState.DEAD)


@dataclass(frozen=True)
class RetryLimits:
    max_retries: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    # A heartbeat saying UNHEALTHY or DEAD this soon after a successful retry was sent before
    # it (heartbeats and replies travel on different subjects); a status event is never stale.
    settle_s: float = 0.5

    @classmethod
    def from_config(cls, ft: FaultToleranceConfig) -> RetryLimits:
        return cls(ft.recovery_max_retries, ft.recovery_backoff_s, ft.recovery_max_backoff_s)

    def backoff(self, num_failures: int) -> float:
        """The wait after the ``num_failures``-th failed retry of a fault (1, 2, ...)."""
        return min(self.backoff_s * 2.0 ** (num_failures - 1), self.max_backoff_s)


@dataclass(frozen=True)
class SendRetry:
    """Send ``retry`` to ``engine_id``; report its outcome with ``on_result(ticket, ...)``."""

    engine_id: str
    ticket: int
    attempt: int  # 1 for the first retry of this fault


@dataclass(frozen=True)
class GiveUp:
    """``num_retries`` retries of this fault failed: stop trying until the fault ends."""

    engine_id: str
    num_retries: int
    fault: str  # the engine core's own reason for the fault
    last_failure: str  # why the last retry failed


Decision = SendRetry | GiveUp


@dataclass
class EngineRecovery:
    """What the policy knows of one engine core."""

    state: ActorState = ActorState.STARTING
    incarnation: str = ""
    retired: set[str] = field(default_factory=set)  # its earlier incarnations
    in_fault: bool = False
    fault: str = ""  # the engine core's reason, from its status event
    num_faults: int = 0  # this engine core's faults so far (the current one's number)
    num_retries: int = 0  # retries sent in this fault
    due_at: float = 0.0  # the next retry of this fault not before
    gave_up: bool = False
    last_failure: str = ""
    in_flight: int | None = None  # the ticket of the retry awaiting its result
    in_flight_fault: int = 0  # the fault it was sent for
    settled_at: float = -math.inf  # when a retry last succeeded

    def open_fault(self, now: float) -> None:
        self.in_fault, self.gave_up = True, False
        self.num_faults += 1
        self.num_retries, self.due_at, self.last_failure = 0, now, ""

    def close_fault(self) -> None:
        self.in_fault, self.gave_up = False, False
        self.num_retries, self.last_failure = 0, ""


class RecoveryPolicy:
    """Engine cores by id, and the counters the controller reports."""

    def __init__(self, limits: RetryLimits) -> None:
        self.limits = limits
        self.engines: dict[str, EngineRecovery] = {}
        self.num_retries_sent = 0
        self.num_retries_succeeded = 0
        self.num_retries_failed = 0
        self.num_given_up = 0
        self._next_ticket = 0

    def observe(
        self,
        engine_id: str,
        state: ActorState,
        now: float,
        *,
        incarnation: str = "",
        reason: str = "",
        is_status: bool = False,
    ) -> None:
        """A heartbeat (``is_status`` False) or status event of ``engine_id``."""
        engine = self.engines.setdefault(engine_id, EngineRecovery())
        if incarnation in engine.retired:
            return  # a late message of a process that is gone
        if incarnation and engine.incarnation and incarnation != engine.incarnation:
            engine.retired.add(engine.incarnation)
            engine.close_fault()  # a new process: the old one's fault went with it
        engine.incarnation = incarnation or engine.incarnation
        if state in FAULTED and not is_status and now - engine.settled_at < self.limits.settle_s:
            return
        engine.state = state
        if state in FAULTED:
            if not engine.in_fault:
                engine.open_fault(now)
            if is_status and reason:
                engine.fault = reason
        elif state in (ActorState.READY, ActorState.STOPPED):
            engine.close_fault()

    def on_result(
        self, engine_id: str, ticket: int, success: bool, reason: str, now: float
    ) -> None:
        """The outcome of ``SendRetry(engine_id, ticket)``: a failure is a rejection, an error
        reply, no reply in time or nobody listening; ``reason`` says which."""
        engine = self.engines.get(engine_id)
        if engine is None or engine.in_flight != ticket:
            return
        engine.in_flight = None
        if success:
            self.num_retries_succeeded += 1
            engine.state, engine.settled_at = ActorState.READY, now  # READY before it replied
            engine.close_fault()
            return
        self.num_retries_failed += 1
        if engine.in_fault and engine.in_flight_fault == engine.num_faults:
            engine.last_failure = reason
            engine.due_at = now + self.limits.backoff(engine.num_retries)

    def poll(self, now: float) -> list[Decision]:
        """What to do now: at most one retry in flight per engine core."""
        decisions: list[Decision] = []
        for engine_id, engine in self.engines.items():
            if not engine.in_fault or engine.gave_up or engine.in_flight is not None:
                continue
            if engine.num_retries >= self.limits.max_retries:
                engine.gave_up = True
                self.num_given_up += 1
                decisions.append(
                    GiveUp(engine_id, engine.num_retries, engine.fault, engine.last_failure)
                )
            elif engine.state is ActorState.UNHEALTHY and now >= engine.due_at:
                decisions.append(self._send(engine_id, engine))
        return decisions

    def _send(self, engine_id: str, engine: EngineRecovery) -> SendRetry:
        self._next_ticket += 1
        engine.num_retries += 1
        engine.in_flight, engine.in_flight_fault = self._next_ticket, engine.num_faults
        self.num_retries_sent += 1
        return SendRetry(engine_id, self._next_ticket, engine.num_retries)
