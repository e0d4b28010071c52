"""The engine core's side of a lock-step group on the bus (``bus/messages/lockstep.py``): it
publishes this rank's report of each round, answers peers (hints, moved reports), and wakes the
step loop when a peer waits for this rank to join a round; with fault tolerance, it agrees with
the other engine cores on the epoch of the workers' rebuilt expert-parallel group, and tells
the step loop when another engine core rebuilds it. The rules live in
``engine/core/lockstep.py`` and ``engine/core/group_rejoin.py``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from shoal.bus.base import Bus, Subscription
from shoal.bus.codec import Codec, encode
from shoal.bus.errors import BusError
from shoal.bus.messages.lockstep import LockstepMessage, LockstepRejoin
from shoal.bus.msg import Msg
from shoal.bus.subjects import Subjects
from shoal.engine.actor.worker_link import WorkerFailure
from shoal.engine.core.group_rejoin import GroupRejoin
from shoal.engine.core.lockstep import Lockstep, RoundOutcome

log = logging.getLogger(__name__)
T = TypeVar("T")
_CODEC: Codec[LockstepMessage] = Codec(LockstepMessage)  # type: ignore[arg-type]


class LockstepTimeout(WorkerFailure):
    """A round's reports did not all arrive in time (a peer engine core is gone or stuck):
    the group's collectives cannot run, so this engine core takes the fault path."""


class LockstepLink:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        rank: int,
        size: int,
        wake: Callable[[], None],
        nonce: str = "",
    ) -> None:
        self.bus = bus
        self.subject = subjects.lockstep()
        self.rounds = Lockstep(rank, size)
        self.rejoin = GroupRejoin(rank, size, nonce)  # nonce: unique per incarnation
        self._wake = wake
        self._changed = asyncio.Event()
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(self.subject, self._on_msg, sequential=True)
        await self.bus.flush()  # the server knows the subscription once start returns: a peer's
        # report sent right after is not lost (a lost one stalled a round until its timeout)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    @property
    def peer_waiting(self) -> bool:
        return self.rounds.peer_waiting

    @property
    def group_broken(self) -> bool:
        """Another engine core rebuilds the workers' group: this one must fault and rejoin."""
        return self.rejoin.peer_rebuilding

    async def _on_msg(self, msg: Msg) -> None:
        try:
            message = _CODEC.decode(msg.data)
            answers: Sequence[LockstepMessage] = (
                self.rejoin.receive(message)
                if isinstance(message, LockstepRejoin)
                else self.rounds.receive(message)
            )
        except Exception:  # a malformed or foreign message must not stop the group
            log.exception("lock-step rank %d: message ignored", self.rounds.rank)
            return
        for answer in answers:
            await self._publish(answer)
        self._changed.set()
        if self.rounds.peer_waiting or self.group_broken:
            self._wake()

    async def _publish(self, message: LockstepMessage) -> None:
        try:
            await self.bus.publish(self.subject, encode(message))
        except BusError:
            log.exception("lock-step rank %d: %r not published", self.rounds.rank, message)

    async def agree(self, num_tokens: int, timeout_s: float) -> RoundOutcome:
        """Report ``num_tokens`` for this rank's next round and wait for every rank's report;
        ``LockstepTimeout`` after ``timeout_s`` (the report is withdrawn, as when the wait is
        cancelled)."""
        report = self.rounds.report(num_tokens)
        await self._publish(report)
        what = f"lock-step round {report.round}"
        try:
            return await self._wait_for(self.rounds.take_outcome, timeout_s, what)
        except (WorkerFailure, asyncio.CancelledError):
            withdrawn = self.rounds.abandon()
            if withdrawn is not None:
                await self._publish(withdrawn)
            raise

    async def agree_group_epoch(self, timeout_s: float) -> str:
        """Propose rebuilding the workers' expert-parallel group and wait until every engine
        core proposes the same generation: its epoch (``LockstepTimeout`` after
        ``timeout_s``)."""
        await self._publish(self.rejoin.propose())
        try:
            epoch = await self._wait_for(
                self.rejoin.take_epoch, timeout_s, "expert-parallel group rebuild"
            )
        except WorkerFailure:
            withdrawn = self.rejoin.abandon()
            if withdrawn is not None:
                await self._publish(withdrawn)
            raise
        return f"experts-{epoch}"

    async def _wait_for(self, take: Callable[[], T | None], timeout_s: float, what: str) -> T:
        """``take()`` once it gives something; ``LockstepTimeout`` after ``timeout_s``, and a
        ``WorkerFailure`` as soon as another engine core rebuilds the group."""
        deadline = time.monotonic() + timeout_s
        while (taken := take()) is None:
            if self.group_broken:
                raise WorkerFailure(f"{what}: another engine core rebuilds the group")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                if (taken := take()) is not None:
                    return taken
                raise LockstepTimeout(
                    f"{what}: not every engine core answered within {timeout_s} s"
                ) from None
        return taken
