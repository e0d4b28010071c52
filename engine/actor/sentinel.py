"""The engine core's fault sentinel: what one fault is, and who may end it.

With fault tolerance on, an exception in the engine core's step loop (its own, or a fatal
worker error) does not fail the engine core for good. The shell (``core_actor``) aborts every
request (resumable), abandons the steps in flight, and hands over to ``FaultSentinel``: the state
is UNHEALTHY while every worker is alive and DEAD while one is gone (re-evaluated while the fault
lasts, so a worker restarted by its supervisor turns DEAD back into UNHEALTHY), and the step loop
waits for ``resumed`` up to ``engine_recovery_timeout_sec``. Recovery commands arrive on the
engine core's control subject, served while the loop waits: ``retry`` is accepted only while
UNHEALTHY (vLLM's rule), one at a time; a successful one sets ``resumed``.

The sentinel also arms ``InjectFault``: the step loop raises ``InjectedFault`` when it is about
to send the armed step. What is here is plain state and rules; the shell does the I/O.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from shoal.bus.messages.control import ActorState
from shoal.bus.messages.fault import (
    INSTRUCTIONS,
    FaultToleranceRequest,
    InjectedFault,
    status_name,
)

# The exit code of an engine core process whose recovery timed out: its supervisor restarts it.
EXIT_RECOVERY_TIMEOUT = 3


@dataclass
class FaultSentinel:
    """One engine core's fault state. ``enabled`` is the deployment's fault tolerance switch."""

    engine_id: str
    enabled: bool
    recovery_timeout_s: float
    fault_info: str = ""  # the current fault's description; "" when healthy
    retrying: bool = False
    num_faults: int = 0
    num_recoveries: int = 0
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    _inject_at: int | None = None
    _inject_message: str = ""

    # ----- fault injection

    def arm(self, next_step: int, after_steps: int, message: str) -> int:
        """Raise at step ``next_step + after_steps``; returns that step number."""
        self._inject_at = next_step + max(0, after_steps)
        self._inject_message = message
        return self._inject_at

    def check_injection(self, step: int) -> None:
        """Raise ``InjectedFault`` if ``step`` is the armed one (it fires once)."""
        if self._inject_at is not None and step >= self._inject_at:
            self._inject_at = None
            raise InjectedFault(f"{self._inject_message} (engine {self.engine_id}, step {step})")

    # ----- one fault

    def begin(self, fault_info: str) -> None:
        self.fault_info = fault_info
        self.num_faults += 1
        self.resumed.clear()

    def end(self) -> None:
        self.fault_info = ""
        self.num_recoveries += 1
        self.resumed.set()

    @staticmethod
    def fault_state(workers_alive: bool) -> ActorState:
        """UNHEALTHY while every worker is alive, DEAD while one is gone."""
        return ActorState.UNHEALTHY if workers_alive else ActorState.DEAD

    def rejection(self, request: FaultToleranceRequest, state: ActorState) -> str | None:
        """Why ``request`` cannot run now, or None."""
        name = request.instruction
        if not self.enabled:
            return f"[FT] Rejecting instruction {name!r}: fault tolerance is off"
        if name not in INSTRUCTIONS:
            return f"[FT] Unknown instruction {name!r}; known: {', '.join(INSTRUCTIONS)}"
        if state is not ActorState.UNHEALTHY:
            status = status_name(state)
            return f"[FT] Rejecting instruction {name!r}: engine {self.engine_id} is {status}"
        if self.retrying:
            return f"[FT] Rejecting instruction {name!r}: a retry is already running"
        return None
