"""The recovery controller actor: the thin shell around ``RecoveryPolicy``.

It watches every engine core's heartbeats and status events, runs the policy on each of them
and on a timer, and carries out its decisions: ``FaultToleranceRequest("retry")`` to
``subjects.control("engine", id)`` (one in flight per engine core, each with a timeout), and a
give-up logged at ERROR and published as this actor's own status reason. A controller that
restarts needs nothing from its predecessor: the next heartbeat of a faulted engine core is
enough to act on.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from shoal.bus.base import Bus
from shoal.bus.codec import Codec, DecodeError
from shoal.bus.errors import BusError
from shoal.bus.messages.control import ControlEvent, StatusEvent
from shoal.bus.messages.fault import (
    RETRY,
    EngineControlReply,
    FaultToleranceRequest,
    FaultToleranceResult,
)
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import Actor, Inbox, call
from shoal.config.deployment import ShoalConfig
from shoal.engine.recovery.policy import GiveUp, RecoveryPolicy, RetryLimits, SendRetry

log = logging.getLogger(__name__)

ENGINE_KIND = "engine"
_CONTROL: Codec[ControlEvent] = Codec(ControlEvent)
_REPLY: Codec[EngineControlReply] = Codec(EngineControlReply)


class RecoveryControllerActor(Actor):
    """Sends ``retry`` to faulted engine cores (``config.fault_tolerance_config``'s limits)."""

    kind = "recovery"

    def __init__(
        self,
        bus: Bus,
        actor_id: str = "recovery-0",
        *,
        config: ShoalConfig,
        retry_timeout_s: float = 60.0,  # a retry re-handshakes the workers: give it time
        tick_s: float = 0.1,
        heartbeat_interval_s: float = 1.0,
    ) -> None:
        super().__init__(
            bus,
            actor_id,
            namespace=config.bus_config.namespace,
            heartbeat_interval_s=heartbeat_interval_s,
        )
        self.config = config
        self.retry_timeout_s = retry_timeout_s
        self.tick_s = tick_s
        self.policy = RecoveryPolicy(RetryLimits.from_config(config.fault_tolerance_config))
        self._request_prefix = f"{actor_id}-{secrets.token_hex(4)}"
        self._tasks: set[asyncio.Task[None]] = set()
        self._ticker: asyncio.Task[None] | None = None

    def inboxes(self) -> Sequence[Inbox]:
        return [
            Inbox(self.subjects.heartbeat(ENGINE_KIND), self.on_control, _CONTROL),
            Inbox(self.subjects.status(ENGINE_KIND), self.on_control, _CONTROL),
        ]

    async def on_start(self) -> None:
        self._ticker = asyncio.create_task(self._tick_loop())

    async def on_stop(self) -> None:
        tasks = [t for t in (self._ticker, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._ticker = None

    def load(self) -> dict[str, float]:
        p = self.policy
        return {
            "num_retries_sent": float(p.num_retries_sent),
            "num_retries_succeeded": float(p.num_retries_succeeded),
            "num_retries_failed": float(p.num_retries_failed),
            "num_given_up": float(p.num_given_up),
        }

    async def on_control(self, event: ControlEvent, msg: Msg) -> None:
        is_status = isinstance(event, StatusEvent)
        reason = event.reason if isinstance(event, StatusEvent) else ""
        self.policy.observe(
            event.actor_id,
            event.state,
            time.monotonic(),
            incarnation=event.incarnation,
            reason=reason,
            is_status=is_status,
        )
        self._act()

    async def _tick_loop(self) -> None:
        while True:
            self._act()
            await asyncio.sleep(self.tick_s)

    def _act(self) -> None:
        for decision in self.policy.poll(time.monotonic()):
            match decision:
                case SendRetry():
                    self._spawn(self._retry(decision))
                case GiveUp():
                    self._spawn(self._give_up(decision))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retry(self, decision: SendRetry) -> None:
        engine_id = decision.engine_id
        request = FaultToleranceRequest(
            RETRY, request_id=f"{self._request_prefix}-{decision.ticket}"
        )
        log.info("%r: retry %d of %s", self, decision.attempt, engine_id)
        success, reason = False, ""
        try:
            reply = await call(
                self.bus,
                self.subjects.control(ENGINE_KIND, engine_id),
                request,
                _REPLY,
                timeout=self.retry_timeout_s,
            )
        except (BusError, DecodeError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        else:
            if isinstance(reply, FaultToleranceResult):
                success, reason = reply.success, reply.reason or ""
            else:
                reason = f"unexpected reply {type(reply).__name__}"
        if success:
            log.info("%r: %s recovered (retry %d)", self, engine_id, decision.attempt)
        else:
            log.warning("%r: retry %d of %s failed: %s", self, decision.attempt, engine_id, reason)
        self.policy.on_result(engine_id, decision.ticket, success, reason, time.monotonic())
        self._act()

    async def _give_up(self, decision: GiveUp) -> None:
        reason = (
            f"gave up on {decision.engine_id} after {decision.num_retries} retries"
            f" (fault: {decision.fault or 'unknown'}; last retry: {decision.last_failure})"
        )
        log.error("%r: %s", self, reason)
        await self.set_state(self.state, reason)
