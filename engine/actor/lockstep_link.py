"""The engine core's side of a lock-step group on the bus (``bus/messages/lockstep.py``): it
publishes this rank's report of each round, answers peers (hints, moved reports), and wakes the
step loop when a peer waits for this rank to join a round. The rules live in
``engine/core/lockstep.py``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from shoal.bus.base import Bus, BusError, Msg, Subscription
from shoal.bus.codec import Codec, encode
from shoal.bus.messages.lockstep import LockstepMessage
from shoal.bus.subjects import Subjects
from shoal.engine.actor.worker_link import WorkerFailure
from shoal.engine.core.lockstep import Lockstep, RoundOutcome

log = logging.getLogger(__name__)
_CODEC: Codec[LockstepMessage] = Codec(LockstepMessage)  # type: ignore[arg-type]


class LockstepTimeout(WorkerFailure):
    """A round's reports did not all arrive in time (a peer engine core is gone or stuck):
    the group's collectives cannot run, so this engine core takes the fault path."""


class LockstepLink:
    def __init__(
        self, bus: Bus, subjects: Subjects, rank: int, size: int, wake: Callable[[], None]
    ) -> None:
        self.bus = bus
        self.subject = subjects.lockstep()
        self.rounds = Lockstep(rank, size)
        self._wake = wake
        self._changed = asyncio.Event()
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(self.subject, self._on_msg, sequential=True)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    @property
    def peer_waiting(self) -> bool:
        return self.rounds.peer_waiting

    async def _on_msg(self, msg: Msg) -> None:
        try:
            message = _CODEC.decode(msg.data)
            answer = self.rounds.receive(message)
        except Exception:  # a malformed or foreign message must not stop the group
            log.exception("lock-step rank %d: message ignored", self.rounds.rank)
            return
        if answer is not None:
            await self._publish(answer)
        self._changed.set()
        if self.rounds.peer_waiting:
            self._wake()

    async def _publish(self, message: LockstepMessage) -> None:
        try:
            await self.bus.publish(self.subject, encode(message))
        except BusError:
            log.exception("lock-step rank %d: %r not published", self.rounds.rank, message)

    async def agree(self, num_tokens: int, timeout_s: float) -> RoundOutcome:
        """Report ``num_tokens`` for this rank's next round and wait for every rank's report;
        ``LockstepTimeout`` after ``timeout_s`` (the report is withdrawn)."""
        await self._publish(self.rounds.report(num_tokens))
        deadline = time.monotonic() + timeout_s
        while (outcome := self.rounds.take_outcome()) is None:
            self._changed.clear()
            left = deadline - time.monotonic()
            try:
                await asyncio.wait_for(self._changed.wait(), max(left, 0.0))
            except TimeoutError:
                if (outcome := self.rounds.take_outcome()) is not None:
                    return outcome
                pending = self.rounds.pending
                self.rounds.abandon()
                raise LockstepTimeout(
                    f"lock-step round {pending.round if pending else '?'}: not every engine "
                    f"core reported within {timeout_s} s"
                ) from None
        return outcome
