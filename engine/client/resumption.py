"""Requests cut by an engine core's fault, waiting to be resumed on a ready one (pure: the
engine client feeds it the clock and does the sending).

A request is *parked* when the engine core it ran on faulted, was lost, restarted or turned it
away as ``unavailable``. It waits at most ``request_resume_timeout_s`` for a ready engine core
(a new fault starts a new wait; a rejection does not) and is resumed at most
``max_request_resumptions`` times (a rejection does not count: nothing it ran was lost). While
parked it avoids the engine core it was cut on until the client sees that one ready after the
cut (its READY status, or the watchdog's next round finding it ready: ``engine_faults``), so it
does not go straight back on what was heard before the fault. Off unless both fault tolerance
and request resumption are on in ``FaultToleranceConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.config.deployment import FaultToleranceConfig
from shoal.engine.client.output_processor import ResumeRequest


@dataclass(slots=True)
class ParkedRequest:
    payload: ResumeRequest
    avoid: str | None  # the engine core it was cut on, until it is seen ready again


class Resumptions:
    """Parked requests, their deadlines and how often each was resumed."""

    def __init__(self, config: FaultToleranceConfig) -> None:
        self.enabled = config.enable_fault_tolerance and config.enable_request_resumption
        self.max_resumptions = config.max_request_resumptions
        self.timeout_s = config.request_resume_timeout_s
        self.parked: dict[str, ParkedRequest] = {}
        self.num_resumptions_total = 0  # faults that parked a request (for tests and metrics)
        self._num_resumed: dict[str, int] = {}
        self._deadline: dict[str, float] = {}

    def may_resume(self, request_id: str, counts: bool = True) -> bool:
        """Whether a request cut now may be resumed (``counts``: a fault, not a rejection)."""
        if not self.enabled:
            return False
        return not counts or self._num_resumed.get(request_id, 0) < self.max_resumptions

    def park(
        self,
        request_id: str,
        payload: ResumeRequest,
        avoid: str | None,
        now: float,
        counts: bool = True,
    ) -> None:
        """Wait for a ready engine core (call ``may_resume`` first)."""
        if counts:
            self._num_resumed[request_id] = self._num_resumed.get(request_id, 0) + 1
            self.num_resumptions_total += 1
        if counts or request_id not in self._deadline:
            self._deadline[request_id] = now + self.timeout_s
        self.parked[request_id] = ParkedRequest(payload, avoid)

    def num_resumed(self, request_id: str) -> int:
        return self._num_resumed.get(request_id, 0)

    def engine_ready_again(self, engine_id: str) -> None:
        """An engine core was seen becoming ready: the requests cut on it may go back."""
        for parked in self.parked.values():
            if parked.avoid == engine_id:
                parked.avoid = None

    def take_expired(self, now: float) -> list[str]:
        """Parked requests past their deadline, forgotten here (to end with an error)."""
        expired = [rid for rid in self.parked if self._deadline[rid] <= now]
        for request_id in expired:
            self.forget(request_id)
        return expired

    def unpark(self, request_id: str) -> None:
        """Sent to an engine core (its deadline stays, in case it is turned away)."""
        self.parked.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed)."""
        self.parked.pop(request_id, None)
        self._num_resumed.pop(request_id, None)
        self._deadline.pop(request_id, None)
