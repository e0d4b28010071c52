"""What the engine client does with its requests when an engine core fails them: the
collaborator (``EngineFaults``) that ``AsyncEngineClient`` holds and calls when it hears of an
engine core, when its own bus connection comes back, and on each round of its watchdog.

The requests of an engine core that stopped, died or came back as a new incarnation (a restarted
process, or one whose bus connection dropped: what was in flight may be lost) end at once with
finish reason "error", and so do all of them when the client's bus connection drops and comes
back; the watchdog does the same for an engine core that went silent, so no caller waits forever.
Every engine core heard of is passed on to ``FaultTolerance.observe``.

Resumption (fault tolerance with ``enable_request_resumption``): instead of ending such a request
(or one its engine core's sentinel ended with a ``resumable`` error, or turned away as
``unavailable``), it parks it (``resumption.Resumptions``) and sends its unfinished completions
again, under fresh ids, to a ready engine core with the tokens already received as
``output_token_ids``; the caller's stream goes on where it was. Outputs of the old attempt are
dropped (``OutputProcessor.prepare_resume``) and the old engine core gets an abort. Parked
requests go out as engine cores become ready, and end with an error once they waited longer than
the resumption timeout. Greedy output equals the uninterrupted run; seeded random sampling is not
bit-exact across a resume (the sampler's generator starts afresh).

It keeps no request bookkeeping of its own: it reads and updates the client's
``placements.RequestPlacements`` (collectors, which engine core and epoch each request went to)
and its output processor, and sends through the client's ``EngineSender``; the client hands it
each of these (composition: it never calls the client back).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from shoal.bus.errors import BusError
from shoal.engine.client.engine_sender import EngineSender
from shoal.engine.client.fault_tolerance import FaultTolerance
from shoal.engine.client.output_processor import OutputProcessor, ResumeRequest
from shoal.engine.client.placements import RequestPlacements
from shoal.engine.client.resumption import Resumptions
from shoal.engine.client.router import EngineRouter

log = logging.getLogger(__name__)


class EngineFaults:
    """Ends or resumes the requests of lost, restarted or silent engine cores for one client:
    its requests in flight are ``placements``, their outputs ``processor()``'s."""

    def __init__(
        self,
        router: EngineRouter,
        fault_tolerance: FaultTolerance,
        resumptions: Resumptions,
        placements: RequestPlacements,
        sender: EngineSender,
        processor: Callable[[], OutputProcessor],
    ) -> None:
        """``processor``: the client's output processor (it exists once the client started)."""
        self.router = router
        self.fault_tolerance = fault_tolerance
        self.resumptions = resumptions
        self._placements = placements
        self._sender = sender
        self._processor = processor
        self._epochs_checked: dict[str, int] = {}  # engine id → last epoch acted upon
        self._ready_seen: set[str] = set()  # engine cores last seen ready (for transitions)

    def check_engine(self, engine_id: str) -> None:
        """Hear of ``engine_id``: tell ``FaultTolerance``; once it is ready again, requests
        parked away from it may go to it; if it is lost, or restarted since they were sent,
        end the client's requests on it (no output of theirs can come any more) or resume them
        (lost: on another engine core; restarted: its new incarnation may take them back)."""
        self.fault_tolerance.observe(engine_id)
        self._note_readiness(engine_id)
        lost, epoch = self.router.is_lost(engine_id), self.router.epoch(engine_id)
        if not lost and self._epochs_checked.get(engine_id, 0) == epoch:
            return
        self._epochs_checked[engine_id] = epoch
        doomed = self._placements.on_engine(engine_id, sent_before=None if lost else epoch)
        reason = "is gone" if lost else "restarted or reconnected to the bus"
        error = f"engine core {engine_id} {reason}"
        for request_id in doomed:
            # A new incarnation is a fresh process: the requests may go back to it at once.
            self.resume_or_fail(request_id, engine_id, error, avoid=lost)

    def on_bus_reconnected(self) -> None:
        """The client's bus connection dropped and came back: outputs (or adds) of every
        request in flight may have gone with it, so each ends with an error now (or resumes)."""
        for request_id, engine_id in self._placements.placed().items():
            error = "the bus connection was lost"
            self.resume_or_fail(request_id, engine_id, error, avoid=False)

    def on_turned_away(self, request_id: str, engine_id: str | None, reason: str) -> None:
        """``engine_id`` turned the request away as unavailable: the request waits for a ready
        engine core (not counted as a fault), away from this one until it is seen ready again
        (``resume_or_fail``)."""
        self.resume_or_fail(request_id, engine_id, reason, counts=False)

    async def watch(self) -> None:
        """The watchdog: fail (or resume) the requests of engine cores that went silent (or
        whose end was missed); send parked requests to engine cores that became ready, end
        expired ones."""
        interval = min(1.0, self.resumptions.timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            for engine_id in list(self.router.engines):
                self._note_readiness(engine_id)
            for engine_id in self.router.lost_engines():
                self.check_engine(engine_id)
            self._resume_parked()

    def _end_with_error(self, request_id: str, engine_id: str | None, error: str) -> None:
        """Finish a request with reason "error"; abort it on the engine core in case a new
        incarnation of it did get it."""
        processor = self._processor()
        engine_ids = processor.engine_request_ids(request_id)
        output = processor.fail_request(request_id, error)
        self.resumptions.forget(request_id)
        collector, _ = self._placements.untrack(request_id)
        if collector is not None and output is not None:
            collector.put(output)
        if engine_ids and engine_id is not None:
            self._sender.abort_later(engine_id, engine_ids)

    # ----- resumption (see resumption.py)

    def resume_or_fail(
        self,
        request_id: str,
        engine_id: str | None,
        error: str,
        *,
        counts: bool = True,
        avoid: bool = True,
    ) -> None:
        """A request its engine core will not finish: park it to resume on a ready engine core
        (``avoid``: not this one until it is seen ready again), or end it with ``error``.
        ``counts``: a fault (counted against max resumptions), not a rejection.

        What the client last heard of an avoided engine core says nothing of its state after
        the cut: its fault's status may have gone with a dropped bus connection (its next READY
        looks like no change), or its fault and its READY after a quick retry may both have
        been heard before the output that cut the request (they travel on other subjects).
        So the next time the watchdog finds it ready counts as ready again: the request goes
        back to it then (and is turned away as unavailable while it still is not)."""
        if request_id not in self._placements:
            return
        if not self.resumptions.may_resume(request_id, counts):
            self._end_with_error(request_id, engine_id, error)
            return
        processor = self._processor()
        old_ids = processor.engine_request_ids(request_id)
        payload = processor.prepare_resume(request_id)
        if payload is None:
            return
        self._placements.detach(request_id)
        if engine_id is not None and old_ids:
            self._sender.abort_later(engine_id, old_ids)
        log.info("resuming %s (%s)", request_id, error)
        if avoid and engine_id is not None:
            self._ready_seen.discard(engine_id)
        now = time.monotonic()
        self.resumptions.park(request_id, payload, engine_id if avoid else None, now, counts)
        self._resume_parked()

    def _resume_parked(self) -> None:
        """Send parked requests to ready engine cores; end those that waited too long."""
        resumptions = self.resumptions
        if not resumptions.parked:
            return
        for request_id in resumptions.take_expired(time.monotonic()):
            timeout = resumptions.timeout_s
            self._end_with_error(
                request_id, None, f"no engine core ready to resume it within {timeout:g} s"
            )
        for request_id, parked in list(resumptions.parked.items()):
            num_requests = max(1, len(parked.payload.children))
            engine = self.router.pick(exclude=parked.avoid, num_requests=num_requests)
            if engine is None:
                continue
            resumptions.unpark(request_id)
            engine_id = engine.engine_id
            self._placements.place(request_id, engine_id, self.router.epoch(engine_id))
            self._sender.spawn(self._send_resumed(request_id, engine_id, parked.payload))

    async def _send_resumed(self, request_id: str, engine_id: str, payload: ResumeRequest) -> None:
        placements = self._placements
        if placements.engine_of(request_id) != engine_id:
            return  # aborted, or moved again, before this ran
        try:
            await self._sender.send_adds(engine_id, payload)
        except BusError as exc:
            if placements.engine_of(request_id) == engine_id:
                error = f"resumed request not sent to {engine_id}: {exc!r}"
                self.resume_or_fail(request_id, engine_id, error, counts=False)

    def _note_readiness(self, engine_id: str) -> None:
        """Track engine cores becoming ready: requests parked away from one may go back."""
        if not self.router.is_ready(engine_id):
            self._ready_seen.discard(engine_id)
        elif engine_id not in self._ready_seen:
            self._ready_seen.add(engine_id)
            self.resumptions.engine_ready_again(engine_id)
            self._resume_parked()
