"""How an engine core lives through a fault: the half of the engine core actor that runs when
its step loop fails (``EngineCoreActor`` derives from it; the step loop calls ``_on_fault``).

- Fault tolerance off: every request ends with a plain error, the engine core waits for its
  workers (the supervisor restarts a dead one) and serves again.
- On (``sentinel.FaultSentinel`` keeps the fault's state and rules): the state first (UNHEALTHY
  with every worker alive, DEAD with one gone, re-read while the fault lasts), then every
  request ends resumable, then the loop waits for a ``retry`` on ``control("engine", id)``,
  served by ``_on_control`` while it waits (the recovery controller sends it). A retry
  handshakes the workers again (reset, and a new tensor-parallel group epoch) and the engine
  core is READY before it answers. No retry within ``engine_recovery_timeout_sec``: a process
  of its own exits (``EXIT_RECOVERY_TIMEOUT``) for its supervisor to restart; in-process it
  restarts in place as a new incarnation. No KV-transfer completions ride on steps yet (KV
  offload), so the abandoned steps carry nothing to keep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from shoal.bus.actor import Actor, new_incarnation
from shoal.bus.errors import BusError
from shoal.bus.messages.control import ActorState
from shoal.bus.messages.fault import (
    EngineControl,
    FaultInjected,
    FaultToleranceRequest,
    FaultToleranceResult,
    InjectFault,
)
from shoal.bus.msg import Msg
from shoal.engine.actor.sentinel import EXIT_RECOVERY_TIMEOUT, FaultSentinel
from shoal.engine.actor.worker_link import WorkerFailure, WorkerLink
from shoal.engine.core.engine_core import ClientOutputs, EngineCore

log = logging.getLogger(__name__)

RETRY_HANDSHAKE_TIMEOUT_S = 30.0  # a retry finds its workers loaded: they heartbeat READY
FAULT_WATCH_INTERVAL_S = 0.25


class FaultHandlingActor(Actor):
    """The fault half of ``EngineCoreActor``, which provides what is declared here."""

    engine_id: str
    sentinel: FaultSentinel
    workers: WorkerLink
    num_steps_sent: int

    async def _publish(self, outputs: ClientOutputs) -> None:
        raise NotImplementedError

    async def _connect_workers(self, timeout_s: float | None = None) -> None:
        raise NotImplementedError

    def _abandon_in_flight(self) -> None:
        raise NotImplementedError

    async def _on_fault(self, core: EngineCore, reason: str) -> None:
        log.error("engine %s: %s; ending every request", self.engine_id, reason)
        self._abandon_in_flight()
        if self.sentinel.enabled:
            await self._wait_for_recovery(core, reason)
        else:
            await self._recover(core, reason)

    async def _release_waiting_workers(self, core: EngineCore) -> None:
        """Workers running an abandoned step that waits for its masks get none (so they finish
        it), where they can still be reached."""
        while core.step_grammars:
            with contextlib.suppress(WorkerFailure):
                await self.workers.send_grammar(core.step_grammars.pop(0))

    async def _recover(self, core: EngineCore, reason: str) -> None:
        """Without fault tolerance: fail every request, wait for the workers, serve again."""
        await self.set_state(ActorState.UNHEALTHY, reason)
        await self._publish(core.fail_all(reason))
        await self._release_waiting_workers(core)
        while True:
            try:
                await self._connect_workers()
                break
            except (WorkerFailure, BusError) as exc:
                log.warning("engine %s: workers not back yet: %s", self.engine_id, exc)
                await asyncio.sleep(1.0)
        await self.set_state(ActorState.READY, "workers reconnected")

    # ----- the sentinel (fault tolerance on)

    async def _wait_for_recovery(self, core: EngineCore, reason: str) -> None:
        """End every request resumable, report UNHEALTHY or DEAD, wait for a retry."""
        self.sentinel.begin(reason)
        # The state first: a client resuming these requests must not pick this engine core.
        await self.set_state(self.sentinel.fault_state(self.workers.all_alive()), reason)
        await self._publish(core.fail_all(reason, resumable=True))
        await self._release_waiting_workers(core)
        watch = asyncio.create_task(self._watch_workers_while_faulted())
        try:
            await asyncio.wait_for(self.sentinel.resumed.wait(), self.sentinel.recovery_timeout_s)
        except TimeoutError:
            await self._recovery_timed_out(core)
        finally:
            watch.cancel()

    async def _watch_workers_while_faulted(self) -> None:
        """DEAD while a worker is gone, UNHEALTHY once all are alive again."""
        while True:
            await asyncio.sleep(FAULT_WATCH_INTERVAL_S)
            wanted = self.sentinel.fault_state(self.workers.all_alive())
            if self.sentinel.fault_info and not self.sentinel.retrying and wanted != self.state:
                await self.set_state(wanted, self.sentinel.fault_info)

    async def _recovery_timed_out(self, core: EngineCore) -> None:
        timeout = self.sentinel.recovery_timeout_s
        if self.owns_bus:
            log.error("engine %s: no recovery within %s s: exiting", self.engine_id, timeout)
            self.exit_code = EXIT_RECOVERY_TIMEOUT
            self.request_stop()
            await asyncio.Event().wait()  # cancelled by stop()
        log.error("engine %s: no recovery within %s s: restarting", self.engine_id, timeout)
        self._life = new_incarnation()  # peers see a restart, as of a new process
        self.sentinel.end()
        await self._recover(core, f"recovery timed out after {timeout} s; restarted")

    async def _on_control(self, message: EngineControl, msg: Msg) -> Any:
        match message:
            case InjectFault():
                at = self.sentinel.arm(self.num_steps_sent, message.after_steps, message.message)
                log.warning("engine %s: fault injection armed at step %d", self.engine_id, at)
                return FaultInjected(self.engine_id, at)
            case FaultToleranceRequest():
                return await self._apply_instruction(message)
        raise TypeError(f"unexpected message {type(message).__name__}")

    async def _apply_instruction(self, request: FaultToleranceRequest) -> FaultToleranceResult:
        """Run a recovery instruction (only ``retry``, only while UNHEALTHY)."""
        rejected = self.sentinel.rejection(request, self.state)
        if rejected is not None:
            log.warning("engine %s: %s", self.engine_id, rejected)
            return FaultToleranceResult(request.request_id, False, rejected)
        self.sentinel.retrying = True  # the worker watch leaves the state alone meanwhile
        try:
            await self._connect_workers(RETRY_HANDSHAKE_TIMEOUT_S)
            # READY before the loop resumes, so no add that arrives now is turned away.
            await self.set_state(ActorState.READY, f"recovered (retry {request.request_id})")
            self.sentinel.end()
        except (WorkerFailure, BusError) as exc:
            log.warning("engine %s: retry failed: %s", self.engine_id, exc)
            return FaultToleranceResult(request.request_id, False, f"[FT] retry failed: {exc}")
        finally:
            self.sentinel.retrying = False
        log.info("engine %s: recovered by retry %s", self.engine_id, request.request_id)
        return FaultToleranceResult(request.request_id, True)
