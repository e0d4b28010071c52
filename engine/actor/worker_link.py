"""An engine core's link to its workers (one per tensor-parallel rank): the handshake, steps
sent to every rank, and liveness from their heartbeats.

Steps go out with ``submit`` (published to every rank in call order, so each worker receives
them in step order; up to two may be in flight with async scheduling) and come back with
``wait``, on one reply subscription of this link. A worker that stops heartbeating, restarts
(its heartbeat sequence starts again) or answers a step with an error fails the step with
``WorkerFailure`` within a bounded time: a killed worker never leaves the engine core waiting
for a reply that cannot come. So does a lost bus connection (once it is back), since replies
sent across the loss may be gone.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from shoal.bus.base import Bus, Subscription
from shoal.bus.codec import Codec, DecodeError
from shoal.bus.errors import BusError
from shoal.bus.messages.control import ActorState
from shoal.bus.messages.offload import KVTransferResult
from shoal.bus.messages.structured import StepGrammar
from shoal.bus.messages.worker import (
    DescribeWorker,
    ExecuteStep,
    GroupJoined,
    JoinGroup,
    ResetWorker,
    StepResult,
    WorkerInfo,
    WorkerOutbound,
)
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import call
from shoal.bus.runtime.liveness import GONE_STATES, LivenessTable, watch_liveness
from shoal.bus.streams import is_no_responders
from shoal.bus.subjects import Subjects

log = logging.getLogger(__name__)

_OUTBOUND: Codec[WorkerOutbound] = Codec(WorkerOutbound)
_STEP: Codec[ExecuteStep] = Codec(ExecuteStep)
_GRAMMAR: Codec[StepGrammar] = Codec(StepGrammar)
GROUP_JOIN_TIMEOUT_S = 60.0  # ranks already loaded: joining is quick unless one is gone
GROUP_JOIN_MIN_S = 10.0  # even when agreeing on the epoch took the handshake's time
_GONE = (ActorState.DRAINING, *GONE_STATES)  # a draining worker takes no more steps


class WorkerFailure(RuntimeError):
    """A worker died, restarted or failed to answer; its persistent batch is lost."""


@dataclass(eq=False)
class SentStep:
    """A step published to every rank, its replies (one future per rank) still to come."""

    step: ExecuteStep
    sent_at: float  # time.monotonic()
    replies: list[asyncio.Future[Msg]] = field(default_factory=list)
    reply_tokens: list[str] = field(default_factory=list)


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
        self.liveness = LivenessTable()
        self._restarts_at_handshake: dict[str, int] = {}
        self.connected_at = 0.0  # time.monotonic() of the last handshake
        self.group_init_methods: dict[str, str] = {}  # the group each rank joined last
        self._subs: list[Subscription] = []
        self._reply_prefix = ""
        self._reply_ids = itertools.count()
        self._replies: dict[str, asyncio.Future[Msg]] = {}
        self._stop_listening: Callable[[], None] | None = None

    async def start(self) -> None:
        self._subs = await watch_liveness(
            self.bus, self.subjects, "worker", self.liveness, only=self.worker_ids
        )
        self._reply_prefix = self.bus.new_inbox()
        self._subs.append(await self.bus.subscribe(f"{self._reply_prefix}.*", self._on_reply))
        await self.bus.flush()
        self._stop_listening = self.bus.on_reconnect(self._fail_waiting)

    def _fail_waiting(self) -> None:
        """The connection was lost and is back: every reply still awaited may be gone. A wait
        reads the first failed reply of its step; the others (another rank's, a later step's
        in flight) are read here, so asyncio does not report them as never retrieved."""
        replies, self._replies = self._replies, {}
        for future in replies.values():
            if not future.done():
                future.set_exception(WorkerFailure("the bus connection was lost mid-step"))
                future.exception()

    async def _on_reply(self, msg: Msg) -> None:
        future = self._replies.pop(msg.subject.rsplit(".", 1)[-1], None)
        if future is not None and not future.done():
            future.set_result(msg)

    async def stop(self) -> None:
        if self._stop_listening is not None:
            self._stop_listening()
            self._stop_listening = None
        subs, self._subs = self._subs, []
        for sub in subs:
            await sub.unsubscribe()

    # ----- liveness

    def lost_reason(self, worker_id: str, started: float, now: float) -> str | None:
        """Why ``worker_id`` counts as lost for a step sent at ``started``, or None."""
        peer = self.liveness.get(worker_id)
        if peer is not None and peer.state in _GONE:
            return f"worker {worker_id} is {peer.state.name}"
        if self.liveness.num_restarts(worker_id) > self._restarts_at_handshake.get(worker_id, 0):
            return f"worker {worker_id} restarted"
        seen = started if peer is None else max(peer.seen_at, started)
        if now - seen > self.dead_after_s:
            return f"worker {worker_id} sent no heartbeat for {now - seen:.1f} s"
        return None

    def lost_worker(self, since: float | None = None) -> str | None:
        """Why a worker counts as lost for a step sent at ``since`` (default: since the last
        handshake, an idle engine core's check), or None."""
        now, since = time.monotonic(), self.connected_at if since is None else since
        for worker_id in self.worker_ids:
            reason = self.lost_reason(worker_id, since, now)
            if reason is not None:
                return reason
        return None

    def all_alive(self) -> bool:
        """Every worker heartbeats READY now (a restarted one counts: it is alive again)."""
        now = time.monotonic()
        for worker_id in self.worker_ids:
            peer = self.liveness.get(worker_id)
            if peer is None or peer.state is not ActorState.READY:
                return False
            if now - max(peer.seen_at, self.connected_at) > self.dead_after_s:
                return False
        return True

    # ----- handshake

    async def handshake(
        self,
        timeout_s: float,
        *,
        group_epoch: str | Callable[[float], Awaitable[str]] | None = None,
    ) -> list[WorkerInfo]:
        """Wait until every rank has loaded its model; with ``group_epoch``, have them all
        (re)build their process group for that epoch (unique per group, across restarts too;
        a callable is awaited with the time left, once the workers are loaded: an epoch agreed
        with other engine cores); reset each (fresh persistent batch)."""
        deadline = time.monotonic() + timeout_s
        infos = []
        for worker_id in self.worker_ids:
            infos.append(await self._describe(worker_id, deadline))
        if group_epoch is not None:
            if not isinstance(group_epoch, str):
                group_epoch = await group_epoch(max(1.0, deadline - time.monotonic()))
            remaining = deadline - time.monotonic()
            timeout_s = max(GROUP_JOIN_MIN_S, min(GROUP_JOIN_TIMEOUT_S, remaining))
            await self._join_group(group_epoch, timeout_s)
        for worker_id in self.worker_ids:
            reset = ResetWorker(f"engine {self.engine_id} (re)connected")
            await call(self.bus, self.subjects.worker_in(worker_id), reset, _OUTBOUND, timeout=30)
        self.mark_connected()
        return infos

    def mark_connected(self) -> None:
        """The workers just answered and were reset: they are alive and READY, and a restart
        or a state seen before now is handled; only later ones fail a step."""
        self.connected_at = time.monotonic()
        for worker_id in self.worker_ids:
            self.liveness.reset(worker_id)
        self._restarts_at_handshake = {w: self.liveness.num_restarts(w) for w in self.worker_ids}

    async def _join_group(self, epoch: str, timeout_s: float) -> None:
        """Every rank joins the group of ``epoch`` at once (they wait for each other)."""
        join = JoinGroup(epoch, timeout_s)
        self.group_init_methods = {}

        async def join_one(worker_id: str) -> None:
            subject = self.subjects.worker_in(worker_id)
            try:
                reply = await call(self.bus, subject, join, _OUTBOUND, timeout=timeout_s + 10)
            except (BusError, DecodeError) as exc:
                raise WorkerFailure(
                    f"worker {worker_id} did not join the group of epoch {epoch}: {exc!r}"
                ) from exc
            if not isinstance(reply, GroupJoined) or reply.epoch != epoch:
                raise WorkerFailure(f"worker {worker_id} answered {reply!r} to JoinGroup")
            self.group_init_methods[worker_id] = reply.init_method

        try:
            async with asyncio.TaskGroup() as tasks:
                for worker_id in self.worker_ids:
                    tasks.create_task(join_one(worker_id))
        except ExceptionGroup as group:
            failures = [e for e in group.exceptions if isinstance(e, WorkerFailure)]
            if not failures:
                raise
            raise failures[0] from None

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
        """Run a step on every rank; rank 0's result is the step's result, with the KV copies
        of every rank (``merge_kv_transfers``)."""
        return await self.wait(await self.submit(step))

    async def submit(self, step: ExecuteStep) -> SentStep:
        """Publish the step to every rank (in order: a later ``submit`` arrives after it)."""
        data = _STEP.encode(step)
        sent = SentStep(step, time.monotonic())
        loop = asyncio.get_running_loop()
        for worker_id in self.worker_ids:
            token = str(next(self._reply_ids))
            sent.replies.append(self._replies.setdefault(token, loop.create_future()))
            sent.reply_tokens.append(token)
            try:
                await self.bus.publish(
                    self.subjects.worker_in(worker_id), data, reply=f"{self._reply_prefix}.{token}"
                )
            except BusError as exc:
                self.forget(sent)
                raise WorkerFailure(f"step {step.step_id} not sent: {exc!r}") from exc
        return sent

    async def send_grammar(self, message: StepGrammar) -> None:
        """A step's late masks to every rank (``StepGrammar``: the step went before them)."""
        data = _GRAMMAR.encode(message)
        for worker_id in self.worker_ids:
            try:
                await self.bus.publish(self.subjects.worker_grammar(worker_id), data)
            except BusError as exc:
                raise WorkerFailure(f"step {message.step_id}'s masks not sent: {exc!r}") from exc

    async def wait(self, sent: SentStep) -> StepResult:
        """Every rank's reply to ``sent``; ``WorkerFailure`` on a lost worker or after
        ``step_timeout_s`` counted from now (a queued step waits for the one before it)."""
        deadline = time.monotonic() + self.step_timeout_s
        try:
            while True:
                _, pending = await asyncio.wait(sent.replies, timeout=0.25)
                if not pending:
                    break
                if time.monotonic() > deadline:
                    raise WorkerFailure(
                        f"step {sent.step.step_id}: no reply within {self.step_timeout_s} s"
                    )
                if (lost := self.lost_worker(sent.sent_at)) is not None:
                    raise WorkerFailure(lost)
        finally:
            self.forget(sent)
        replies = [future.result() for future in sent.replies]
        for worker_id, reply in zip(self.worker_ids, replies, strict=True):
            if is_no_responders(reply):
                raise WorkerFailure(f"worker {worker_id} is not listening")
        return self._decode_result(sent.step, replies)

    def forget(self, sent: SentStep) -> None:
        """Stop waiting for ``sent``'s replies (a late one is dropped)."""
        for token in sent.reply_tokens:
            future = self._replies.pop(token, None)
            if future is not None:
                future.cancel()

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
        chosen = results[0]
        for result in results[1:]:
            if result.error is not None and results[0].error is None:
                chosen = result  # a failing rank fails the step
                break
        if len(results) > 1:
            chosen.kv_transfer = merge_kv_transfers([r.kv_transfer for r in results])
        return chosen


def merge_kv_transfers(
    per_rank: Sequence[KVTransferResult | None],
) -> KVTransferResult | None:
    """The step's KV copies over every rank: what failed on any rank, the bytes all ranks
    moved, and the slowest rank's seconds (the ranks copy at once)."""
    present = [r for r in per_rank if r is not None]
    if not present:
        return None
    return KVTransferResult(
        failed_load_req_ids=list(
            dict.fromkeys(req_id for r in present for req_id in r.failed_load_req_ids)
        ),
        failed_store_job_ids=list(
            dict.fromkeys(job_id for r in present for job_id in r.failed_store_job_ids)
        ),
        num_load_bytes=sum(r.num_load_bytes for r in present),
        num_store_bytes=sum(r.num_store_bytes for r in present),
        load_time_s=max(r.load_time_s for r in present),
        store_time_s=max(r.store_time_s for r in present),
        failed_pull_req_ids=list(
            dict.fromkeys(req_id for r in present for req_id in r.failed_pull_req_ids)
        ),
        num_pull_bytes=sum(r.num_pull_bytes for r in present),
        pull_time_s=max(r.pull_time_s for r in present),
    )
