"""How an engine core lives through a fault: ``FaultHandler``, which the engine core actor
holds and hands a fault to when its step loop fails (``on_fault``, the steps in flight already
abandoned), and the recovery commands that arrive on its control subject (``on_command``).
The handler drives the actor's state (the ``Actor``'s public lifecycle) and reaches the rest
of the engine core through two calls it is given: publish outputs, (re)connect the workers.

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
from collections.abc import Awaitable, Callable

from shoal.bus.errors import BusError
from shoal.bus.messages.control import ActorState
from shoal.bus.messages.fault import (
    FaultInjected,
    FaultToleranceRequest,
    FaultToleranceResult,
    InjectFault,
)
from shoal.bus.runtime.actor import Actor
from shoal.engine.actor.sentinel import EXIT_RECOVERY_TIMEOUT, FaultSentinel
from shoal.engine.actor.worker_link import WorkerFailure, WorkerLink
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.core.request import ClientOutputs

log = logging.getLogger(__name__)

RETRY_HANDSHAKE_TIMEOUT_S = 30.0  # a retry finds its workers loaded: they heartbeat READY
FAULT_WATCH_INTERVAL_S = 0.25


Publish = Callable[[ClientOutputs], Awaitable[None]]
ConnectWorkers = Callable[[float | None], Awaitable[None]]


class FaultHandler:
    """What an engine core actor does from a fault to serving again."""

    def __init__(
        self,
        actor: Actor,
        sentinel: FaultSentinel,
        workers: WorkerLink,
        publish: Publish,
        connect_workers: ConnectWorkers,
    ) -> None:
        """``publish``: send a core call's outputs to their clients; ``connect_workers``:
        handshake the workers again (within the timeout given, None: the actor's own)."""
        self.actor = actor
        self.engine_id = actor.actor_id
        self.sentinel = sentinel
        self.workers = workers
        self._publish = publish
        self._connect_workers = connect_workers

    async def on_fault(self, core: EngineCore, reason: str) -> None:
        """End every request of ``core`` (its steps in flight abandoned by the caller) and
        return once the engine core serves again."""
        log.error("engine %s: %s; ending every request", self.engine_id, reason)
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
        await self.actor.set_state(ActorState.UNHEALTHY, reason)
        await self._publish(core.fail_all(reason))
        await self._release_waiting_workers(core)
        while True:
            try:
                await self._connect_workers(None)
                break
            except (WorkerFailure, BusError) as exc:
                log.warning("engine %s: workers not back yet: %s", self.engine_id, exc)
                await asyncio.sleep(1.0)
        await self.actor.set_state(ActorState.READY, "workers reconnected")

    # ----- the sentinel (fault tolerance on)

    async def _wait_for_recovery(self, core: EngineCore, reason: str) -> None:
        """End every request resumable, report UNHEALTHY or DEAD, wait for a retry."""
        self.sentinel.begin(reason)
        # The state first: a client resuming these requests must not pick this engine core.
        await self.actor.set_state(self.sentinel.fault_state(self.workers.all_alive()), reason)
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
            if (
                self.sentinel.fault_info
                and not self.sentinel.retrying
                and wanted != self.actor.state
            ):
                await self.actor.set_state(wanted, self.sentinel.fault_info)

    async def _recovery_timed_out(self, core: EngineCore) -> None:
        timeout = self.sentinel.recovery_timeout_s
        if self.actor.owns_bus:
            log.error("engine %s: no recovery within %s s: exiting", self.engine_id, timeout)
            await self.actor.exit_for_restart(EXIT_RECOVERY_TIMEOUT)
        log.error("engine %s: no recovery within %s s: restarting", self.engine_id, timeout)
        self.actor.begin_new_life()
        self.sentinel.end()
        await self._recover(core, f"recovery timed out after {timeout} s; restarted")

    def arm(self, injection: InjectFault, num_steps_sent: int) -> FaultInjected:
        """A fault to inject ``injection.after_steps`` steps after the ``num_steps_sent``."""
        at = self.sentinel.arm(num_steps_sent, injection.after_steps, injection.message)
        log.warning("engine %s: fault injection armed at step %d", self.engine_id, at)
        return FaultInjected(self.engine_id, at)

    async def apply_instruction(self, request: FaultToleranceRequest) -> FaultToleranceResult:
        """Run a recovery instruction (only ``retry``, only while UNHEALTHY)."""
        rejected = self.sentinel.rejection(request, self.actor.state)
        if rejected is not None:
            log.warning("engine %s: %s", self.engine_id, rejected)
            return FaultToleranceResult(request.request_id, False, rejected)
        self.sentinel.retrying = True  # the worker watch leaves the state alone meanwhile
        try:
            await self._connect_workers(RETRY_HANDSHAKE_TIMEOUT_S)
            # READY before the loop resumes, so no add that arrives now is turned away.
            await self.actor.set_state(ActorState.READY, f"recovered (retry {request.request_id})")
            self.sentinel.end()
        except (WorkerFailure, BusError) as exc:
            log.warning("engine %s: retry failed: %s", self.engine_id, exc)
            return FaultToleranceResult(request.request_id, False, f"[FT] retry failed: {exc}")
        finally:
            self.sentinel.retrying = False
        log.info("engine %s: recovered by retry %s", self.engine_id, request.request_id)
        return FaultToleranceResult(request.request_id, True)
