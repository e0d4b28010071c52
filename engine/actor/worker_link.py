"""An engine core's link to its workers (one per tensor-parallel rank): the handshake, steps
sent to every rank, and liveness from their heartbeats.

A worker that stops heartbeating, restarts (its heartbeat sequence starts again) or answers a
step with an error fails the step with ``WorkerFailure`` within a bounded time: a killed
worker never leaves the engine core waiting for a reply that cannot come.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from shoal.bus.actor import call
from shoal.bus.base import Bus, BusError, Msg, Subscription
from shoal.bus.codec import Codec, DecodeError
from shoal.bus.messages.control import ActorState, ControlEvent, Heartbeat, StatusEvent
from shoal.bus.messages.worker import (
    DescribeWorker,
    ExecuteStep,
    ResetWorker,
    StepResult,
    WorkerInfo,
    WorkerOutbound,
)
from shoal.bus.subjects import Subjects

log = logging.getLogger(__name__)

_OUTBOUND: Codec[WorkerOutbound] = Codec(WorkerOutbound)
_CONTROL: Codec[ControlEvent] = Codec(ControlEvent)
_STEP: Codec[ExecuteStep] = Codec(ExecuteStep)
_GONE = (ActorState.DRAINING, ActorState.DEAD, ActorState.STOPPED)


class WorkerFailure(RuntimeError):
    """A worker died, restarted or failed to answer; its persistent batch is lost."""


class WorkerLink:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        engine_id: str,
        worker_ids: Sequence[str],
        *,
        dead_after_s: float = 5.0,
        step_timeout_s: float = 120.0,
    ) -> None:
        if not worker_ids:
            raise ValueError("an engine core needs at least one worker")
        self.bus = bus
        self.subjects = subjects
        self.engine_id = engine_id
        self.worker_ids = list(worker_ids)
        self.dead_after_s = dead_after_s
        self.step_timeout_s = step_timeout_s
        self.infos: dict[str, WorkerInfo] = {}
        self._last_seen: dict[str, float] = {}
        self._last_seq: dict[str, int] = {}
        self._lost: dict[str, str] = {}  # worker id → why it is considered lost
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        for subject in (self.subjects.heartbeat("worker"), self.subjects.status("worker")):
            self._subs.append(await self.bus.subscribe(subject, self._on_control))

    async def stop(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            await sub.unsubscribe()

    # ----- liveness

    async def _on_control(self, msg: Msg) -> None:
        try:
            event = _CONTROL.decode(msg.data)
        except DecodeError:
            return
        if event.actor_id not in self.worker_ids:
            return
        match event:
            case Heartbeat():
                self._on_heartbeat(event)
            case StatusEvent():
                if event.state in _GONE:
                    self._lost[event.actor_id] = f"worker {event.actor_id} is {event.state.name}"
                elif event.state is ActorState.STARTING:
                    self._lost[event.actor_id] = f"worker {event.actor_id} restarted"

    def _on_heartbeat(self, beat: Heartbeat) -> None:
        previous = self._last_seq.get(beat.actor_id)
        if previous is not None and beat.seq < previous:
            self._lost[beat.actor_id] = f"worker {beat.actor_id} restarted"
        self._last_seq[beat.actor_id] = beat.seq
        self._last_seen[beat.actor_id] = time.monotonic()

    def _check_alive(self, started: float) -> None:
        now = time.monotonic()
        for worker_id in self.worker_ids:
            if worker_id in self._lost:
                raise WorkerFailure(self._lost[worker_id])
            seen = self._last_seen.get(worker_id, started)
            if now - max(seen, started) > self.dead_after_s:
                raise WorkerFailure(f"worker {worker_id} sent no heartbeat for {now - seen:.1f} s")

    # ----- handshake

    async def handshake(self, timeout_s: float) -> list[WorkerInfo]:
        """Wait until every rank has loaded its model; reset each (fresh persistent batch)."""
        deadline = time.monotonic() + timeout_s
        infos = []
        for worker_id in self.worker_ids:
            infos.append(await self._describe(worker_id, deadline))
        for worker_id in self.worker_ids:
            reset = ResetWorker(f"engine {self.engine_id} (re)connected")
            await call(self.bus, self.subjects.worker_in(worker_id), reset, _OUTBOUND, timeout=30)
        self.infos = {info.worker_id: info for info in infos}
        self._lost.clear()
        self._last_seq.clear()
        return infos

    async def _describe(self, worker_id: str, deadline: float) -> WorkerInfo:
        subject = self.subjects.worker_in(worker_id)
        delay = 0.05
        while True:
            remaining = deadline - time.monotonic()
            try:
                reply = await call(
                    self.bus,
                    subject,
                    DescribeWorker(self.engine_id),
                    _OUTBOUND,
                    timeout=max(0.1, min(remaining, 30.0)),
                )
            except BusError as exc:
                if time.monotonic() + delay >= deadline:
                    raise WorkerFailure(f"worker {worker_id} did not answer: {exc!r}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if not isinstance(reply, WorkerInfo):
                raise WorkerFailure(f"worker {worker_id} answered {type(reply).__name__}")
            return reply

    # ----- steps

    async def execute(self, step: ExecuteStep) -> StepResult:
        """Run a step on every rank; rank 0's result is the step's result."""
        data = _STEP.encode(step)
        started = time.monotonic()
        tasks = [
            asyncio.create_task(
                self.bus.request(self.subjects.worker_in(w), data, timeout=self.step_timeout_s)
            )
            for w in self.worker_ids
        ]
        try:
            while True:
                done, _ = await asyncio.wait(tasks, timeout=0.25)
                for task in done:
                    task.result()  # raises the first failure
                if len(done) == len(tasks):
                    break
                self._check_alive(started)
            replies = [t.result() for t in tasks]
        except (TimeoutError, BusError) as exc:
            raise WorkerFailure(f"step {step.step_id} failed on the bus: {exc!r}") from exc
        finally:
            for task in tasks:
                task.cancel()
        return self._decode_result(step, replies)

    def _decode_result(self, step: ExecuteStep, replies: list[Msg]) -> StepResult:
        results = []
        for worker_id, reply in zip(self.worker_ids, replies, strict=True):
            try:
                result = _OUTBOUND.decode(reply.data)
            except DecodeError as exc:
                raise WorkerFailure(f"worker {worker_id} sent an undecodable reply: {exc}") from exc
            if not isinstance(result, StepResult):
                raise WorkerFailure(f"worker {worker_id} answered {type(result).__name__}")
            results.append(result)
        for result in results[1:]:
            if result.error is not None and results[0].error is None:
                return result  # a failing rank fails the step
        return results[0]
