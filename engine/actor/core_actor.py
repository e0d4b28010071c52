"""The engine core actor: a thin async shell around ``EngineCore`` (one per data-parallel rank).

Inbox ``engine_in(engine_id)``: ``AddRequest`` / ``AbortRequest`` / ``ReleaseKV`` (prompt KV
held for a remote decode may go), queued and applied together before each step. The step loop
sleeps while there is nothing to do, then: apply inputs, schedule and send a step to the workers
(``WorkerLink.submit``) while the core has room for one more in flight, else await the oldest
step's result, apply it (aborts that arrived meanwhile first) and publish one ``EngineOutputs``
per client (and, for prefix routing, one batch of KV events: ``KvEventsLink``). With
``async_scheduling`` the core allows two steps in flight, so step N+1 is sent before step N's
result is back and the worker never waits for this loop (but for the first step after the core
was idle, landed before the next is scheduled so that a burst still arriving joins the next);
without it each step is awaited before the next is scheduled. The order rules (results applied
strictly in step order, placeholders) live in ``EngineCore``. ``EngineStats`` go out after steps
(at most every ``stats_interval_s``) and on every heartbeat, so clients can discover and route
by load. While idle, the loop still checks its workers' heartbeats, so a dead worker is noticed
within ``worker_dead_after_s``, not at the next request.

Expert parallelism (``ParallelConfig.runs_in_lockstep``): every step is a round agreed with the
other engine cores over the bus first (``LockstepLink``); a rank without tokens sends its
workers a dummy step so the group's collectives can run, and with fault tolerance each
handshake agrees the epoch of the workers' rebuilt group with the other engine cores.

Tracing (``--otlp-traces-endpoint``): ``request_tracing.RequestTracing`` keeps the spans of the
requests whose adds carried a sampled trace context, and each step tells the workers its span
for each of them (``ExecuteStep.trace_parents``).

Faults: an exception in a step (the core's, the bus's, a lost or restarted worker, or with fault
tolerance on a fatal worker error) abandons the steps in flight and ends every request; what
follows (today's recovery, or the fault-tolerance sentinel and its recovery commands) is
``fault_handling.FaultHandler``, which this actor holds. A worker error that is not fatal
(``StepError.fatal`` False) fails only the requests it names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

from shoal.bus.base import Bus
from shoal.bus.codec import Codec, encode
from shoal.bus.errors import BusError
from shoal.bus.messages.control import ActorState
from shoal.bus.messages.engine import (
    AbortRequest,
    AddRequest,
    EngineInbound,
    EngineOutputs,
    EngineStats,
    ReleaseKV,
    RequestRejected,
    SchedulerStats,
)
from shoal.bus.messages.fault import EngineControl, FaultToleranceRequest, InjectFault
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import Actor, Inbox
from shoal.config.deployment import ShoalConfig
from shoal.engine.actor.fault_handling import FaultHandler
from shoal.engine.actor.kv_events_link import KvEventsLink
from shoal.engine.actor.lockstep_link import LockstepLink
from shoal.engine.actor.offload_link import OffloadLink, kv_layout
from shoal.engine.actor.request_tracing import RequestTracing
from shoal.engine.actor.sentinel import FaultSentinel
from shoal.engine.actor.worker_link import SentStep, WorkerFailure, WorkerLink
from shoal.engine.core.engine_core import EngineCore, kv_cache_shape
from shoal.engine.core.request import ClientOutputs, merge_outputs
from shoal.engine.core.scheduler_output import SchedulerOutput
from shoal.engine.core.scheduler_stats import StepTiming
from shoal.engine.structured.backend import XgrammarBackend
from shoal.tracing.setup import actor_tracer, close_tracer

log = logging.getLogger(__name__)


class EngineCoreActor(Actor):
    kind: ClassVar[str] = "engine"
    # A reconnect may have lost adds and outputs in flight: clients end the requests that
    # straddle it, as after a restart.
    new_incarnation_on_reconnect: ClassVar[bool] = True

    def __init__(
        self,
        bus: Bus,
        engine_id: str,
        *,
        config: ShoalConfig,
        worker_ids: Sequence[str],
        dp_rank: int = 0,
        startup_timeout_s: float = 600.0,
        stats_interval_s: float = 0.05,
        heartbeat_interval_s: float = 1.0,
    ) -> None:
        super().__init__(
            bus,
            engine_id,
            namespace=config.bus_config.namespace,
            heartbeat_interval_s=heartbeat_interval_s,
        )
        self.engine_id = engine_id
        self.config = config
        # Disaggregated prefill: "prefill", "decode" or "both" (config.disaggregation).
        self.kv_role = config.disaggregation_config.role_of(dp_rank)
        self.startup_timeout_s = startup_timeout_s
        self.stats_interval_s = stats_interval_s
        self.workers = WorkerLink(
            bus,
            self.subjects,
            engine_id,
            worker_ids,
            dead_after_s=config.parallel_config.worker_dead_after_s,
            step_timeout_s=config.parallel_config.step_timeout_s,
        )
        self.core: EngineCore | None = None
        self.num_blocks = 0
        self.max_model_len = 0
        self._codec: Codec[EngineInbound] = Codec(EngineInbound)
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._last_stats_time = 0.0
        # Cumulative step timing, published in SchedulerStats (bench/throughput_e2e.py).
        self.timing = StepTiming()
        self.tracing: RequestTracing | None = None  # with --otlp-traces-endpoint
        # Steps sent, oldest first, each with whether the core had work when it was sent (False:
        # the first step after an idle spell: the worker's idle time before it does not count,
        # and it is landed before the next is scheduled).
        self._in_flight: deque[tuple[SchedulerOutput, SentStep, bool]] = deque()
        self._busy = False  # had work since the last step was sent
        ft = config.fault_tolerance_config
        self.sentinel = FaultSentinel(
            engine_id, ft.enable_fault_tolerance, ft.engine_recovery_timeout_sec
        )
        self.faults = FaultHandler(
            self, self.sentinel, self.workers, self._publish, self._connect_workers
        )
        self._control_codec: Codec[EngineControl] = Codec(EngineControl)
        self.num_steps_sent = 0
        self.num_handshakes = 0
        self._make_links(bus, config, dp_rank)

    def _make_links(self, bus: Bus, config: ShoalConfig, dp_rank: int) -> None:
        """The links only some deployments need: lock-step rounds (expert parallelism), KV
        offload, KV events (prefix routing)."""
        engine_id = self.engine_id
        parallel = config.parallel_config
        self.lockstep = (
            LockstepLink(
                bus,
                self.subjects,
                dp_rank,
                parallel.data_parallel_size,
                self._wake.set,
                nonce=self.incarnation,
            )
            if parallel.runs_in_lockstep
            else None
        )
        self.offload = (
            OffloadLink(
                bus,
                self.subjects,
                config,
                f"{engine_id}.{self.incarnation}",
                self._wake.set,
            )
            if config.kv_transfer_config.enabled
            else None
        )
        replicas = config.bus_config.jetstream_replicas
        self.kv_events = (
            KvEventsLink(
                bus,
                self.subjects,
                engine_id,
                replicas,
                config.parallel_config.kv_events_snapshot_interval_s,
            )
            if config.resolved_routing_mode == "kv"
            else None
        )

    # ----- lifecycle

    def inboxes(self) -> Sequence[Inbox]:
        # Sequential: an abort must never overtake the add it cancels.
        subject = self.subjects.engine_in(self.engine_id)
        control = self.subjects.control(self.kind, self.engine_id)
        return [
            Inbox(subject, self._on_inbound, self._codec, sequential=True),
            Inbox(control, self._on_control, self._control_codec),
        ]

    async def on_start(self) -> None:
        tracer = actor_tracer(self.config.observability_config, self.kind, self.engine_id)
        if tracer is not None:
            self.tracing = RequestTracing(tracer, self.engine_id, lambda: self.incarnation)
        if self.kv_events is not None:
            await self.kv_events.start()
        if self.lockstep is not None:
            await self.lockstep.start()
        await self.workers.start()
        await self._connect_workers()

    async def start(self) -> None:
        await super().start()
        self._loop_task = asyncio.create_task(self._step_loop(), name=f"steps-{self.engine_id}")
        await self._publish_stats()
        if self.kv_events is not None:  # a fresh incarnation: clients drop what they knew
            await self.kv_events.publish(self.core, self.incarnation)

    async def on_stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self._abandon_in_flight()
        if self.core is not None:
            reason = f"engine {self.engine_id} stopped"
            await self._publish(self.core.fail_all(reason, resumable=self.sentinel.enabled))
        if self.offload is not None:
            await self.offload.stop()
        if self.kv_events is not None:
            self.kv_events.stop()
        if self.lockstep is not None:
            await self.lockstep.stop()
        await self.workers.stop()
        if self.tracing is not None:
            self.tracing.close(f"engine {self.engine_id} stopped")
            await close_tracer(self.tracing.tracer)

    async def _connect_workers(self, timeout_s: float | None = None) -> None:
        infos = await self.workers.handshake(
            timeout_s or self.startup_timeout_s, group_epoch=self._group_epoch()
        )
        num_blocks, max_model_len = shape = kv_cache_shape(self.config, infos)
        if self.core is None or shape != (self.num_blocks, self.max_model_len):
            self.core = EngineCore(
                self.config.scheduler_config,
                self.config.cache_config,
                num_blocks=num_blocks,
                max_model_len=max_model_len,
                kv_transfer_config=self.config.kv_transfer_config,
                speculative_config=self.config.speculative_config,
                grammar_backend=XgrammarBackend(
                    self.config.model_config.tokenizer or self.config.model_config.model,
                    infos[0].vocab_size,
                    infos[0].eos_token_ids,
                ),
                kv_handover_lease_s=self.config.disaggregation_config.kv_handover_lease_s,
                lora_config=self.config.lora_config,
            )
        exports = [info.kv_export for info in infos if info.kv_export is not None]
        self.core.set_kv_source(self.engine_id, exports if len(exports) == len(infos) else [])
        self.num_blocks, self.max_model_len = num_blocks, max_model_len
        if self.offload is not None and self.core.offload is not None:
            try:
                self.offload.attach(kv_layout(self.config, infos), self.core.offload)
            except ValueError as exc:
                log.error("engine %s: KV offload stays off: %s", self.engine_id, exc)
        log.info(
            "engine %s: %d workers ready, %d KV blocks", self.engine_id, len(infos), num_blocks
        )

    def _group_epoch(self) -> str | Callable[[float], Awaitable[str]] | None:
        """The epoch of the workers' process group to (re)build at this handshake, with fault
        tolerance on: an expert-parallel group's is agreed with the other engine cores; a
        tensor-parallel group's is this engine core's own (unique across its restarts too)."""
        if not self.sentinel.enabled:
            return None  # the groups are static
        if self.lockstep is not None:
            return self.lockstep.agree_group_epoch
        self.num_handshakes += 1
        if self.config.parallel_config.tensor_parallel_size > 1:
            return f"{self.incarnation}-{self.num_handshakes}"
        return None

    def served_engine(self) -> str:
        return self.engine_id

    def load(self) -> dict[str, float]:
        if self.core is None:
            return {}
        stats = self.core.stats()
        return {
            "num_running": float(stats.num_running),
            "num_waiting": float(stats.num_waiting),
            "num_steps": float(self.num_steps_sent),
            "kv_usage": stats.kv_usage,
            "num_faults": float(self.sentinel.num_faults),
            "num_recoveries": float(self.sentinel.num_recoveries),
            **(
                {"num_lockstep_rounds": float(self.lockstep.rounds.next_round)}
                if self.lockstep
                else {}
            ),
        }

    # ----- inputs

    async def _on_inbound(self, message: EngineInbound, msg: Msg) -> None:
        core = self.core
        if core is None:
            return
        match message:
            case AddRequest():
                if self.tracing is not None:
                    self.tracing.on_add(message, msg.headers)
                rejected: RequestRejected | None
                if self.state is not ActorState.READY:
                    core.turn_away(message)
                    rejected = RequestRejected(
                        message.request_id, "unavailable", f"engine {self.engine_id} is recovering"
                    )
                else:
                    rejected = core.admit(message)
                if rejected is not None:
                    self._traced_turn_away(rejected)
                    await self._send(message.client_id, rejected)
                    await self._publish({})  # (the KV a remote prefill held for it may go)
                    return
            case AbortRequest():
                core.queue_abort(message)
            case ReleaseKV():
                core.queue_release(message)
        self._wake.set()

    # ----- the step loop

    async def _step_loop(self) -> None:
        while True:
            core = self.core
            assert core is not None
            if not core.has_work() and not self._peer_waiting():
                self._busy = False  # the worker's wait for the next step is not idleness
                self._wake.clear()
                await self._publish_stats(force=True)  # also lets new clients discover us
                if self.kv_events is not None:  # an idle engine core's periodic snapshot
                    await self.kv_events.publish(self.core, self.incarnation)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.heartbeat_interval_s)
                if (lost := self.workers.lost_worker() or self._group_broken()) is not None:
                    await self._on_fault(core, lost)
                continue
            try:
                await self._step(core)
            except WorkerFailure as exc:
                await self._on_fault(core, str(exc))
            except Exception as exc:
                log.exception("engine %s: step failed", self.engine_id)
                await self._on_fault(core, f"engine step failed: {type(exc).__name__}: {exc}")

    async def _on_fault(self, core: EngineCore, reason: str) -> None:
        self._abandon_in_flight()
        await self.faults.on_fault(core, reason)

    async def _on_control(self, message: EngineControl, msg: Msg) -> Any:
        match message:
            case InjectFault():
                return self.faults.arm(message, self.num_steps_sent)
            case FaultToleranceRequest():
                return await self.faults.apply_instruction(message)
        raise TypeError(f"unexpected message {type(message).__name__}")

    async def _step(self, core: EngineCore) -> None:
        outputs, rejected = core.apply_inputs()
        for client_id, rejection in rejected:
            self._traced_turn_away(rejection)
            await self._send(client_id, rejection)
        sent = core.can_schedule and await self._submit_next(core)
        look_ahead = sent and core.can_schedule and not self._woke_with_this_step()
        if self._in_flight and not look_ahead:
            merge_outputs(outputs, await self._land_oldest(core))
        elif not sent and not outputs and not core.has_inputs:
            await asyncio.sleep(0.001)  # nothing runnable yet: do not spin
        await self._publish(outputs)
        await self._publish_stats()

    def _woke_with_this_step(self) -> bool:
        """The one step in flight is the first since the core was idle: landed before the next
        is scheduled, so that a burst of requests still arriving joins the next step rather
        than wait behind a step sent ahead with the burst's first few (async scheduling)."""
        return len(self._in_flight) == 1 and not self._in_flight[0][2]  # (sent from idle)

    def _peer_waiting(self) -> bool:
        return self.lockstep is not None and self.lockstep.peer_waiting

    def _group_broken(self) -> str | None:
        if self.lockstep is not None and self.lockstep.group_broken:
            return "another engine core rebuilds the expert-parallel group"
        return None

    async def _submit_next(self, core: EngineCore) -> bool:
        """Schedule a step and send it; False when there was nothing to run. In a lock-step
        group the engine cores first agree on the round: all step (a rank without tokens
        sends a dummy) if any has tokens."""
        traced = self.tracing is not None
        schedule_start_ns = time.time_ns() if traced else 0
        scheduler_output = core.schedule()
        schedule_end_ns = time.time_ns() if traced else 0
        in_round = False
        if self.lockstep is not None:
            num_tokens = scheduler_output.total_num_scheduled_tokens if scheduler_output else 0
            if num_tokens or self.lockstep.peer_waiting:  # no round while nobody can run one
                self.sentinel.check_injection(self.num_steps_sent)  # before peers run it
                in_round = await self._agree_while_landing(core, num_tokens)
            if in_round and not num_tokens:
                scheduler_output = core.hold_dummy(scheduler_output)
        if scheduler_output is None or (scheduler_output.is_empty and not in_round):
            return False
        if not in_round:
            self.sentinel.check_injection(self.num_steps_sent)
        self.num_steps_sent += 1
        message = scheduler_output.to_message()
        message.lockstep = in_round
        if self.tracing is not None:
            message.trace_parents = self.tracing.on_step_sent(
                scheduler_output, schedule_start_ns, schedule_end_ns
            )
        sent = await self.workers.submit(message)
        if self.offload is not None:
            self.offload.flush()  # lookups of requests parked by this schedule go out now
        self._in_flight.append((scheduler_output, sent, self._busy))
        self._busy = True
        return True

    async def _agree_while_landing(self, core: EngineCore, num_tokens: int) -> bool:
        """Agree on this rank's next lock-step round (whether it runs), landing the steps in
        flight as their results come meanwhile: a peer whose worker died answers no round
        until it is back, and this rank's own failed step must end its requests at once, not
        after the round's timeout."""
        assert self.lockstep is not None
        timeout_s = self.config.parallel_config.step_timeout_s
        agree = asyncio.ensure_future(self.lockstep.agree(num_tokens, timeout_s))
        try:
            while not agree.done():
                replies = self._in_flight[0][1].replies if self._in_flight else []
                if replies and all(reply.done() for reply in replies):
                    await self._publish(await self._land_oldest(core))
                    continue
                waiting: set[asyncio.Future[Any]] = {agree, *replies}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not agree.done():
                agree.cancel()  # (its report is withdrawn)
                with contextlib.suppress(asyncio.CancelledError):
                    await agree
        return agree.result().runs

    async def _land_oldest(self, core: EngineCore) -> ClientOutputs:
        """Await the oldest step's result and apply it."""
        scheduler_output, sent, count_idle = self._in_flight[0]
        result = await self.workers.wait(sent)
        self._in_flight.popleft()
        self.timing.count(time.monotonic() - sent.sent_at, result, count_idle)
        if not any(step is scheduler_output for step in core.outstanding):
            log.warning("engine %s: step %d was abandoned", self.engine_id, result.step_id)
            return {}
        if result.error is not None and result.error.fatal and self.sentinel.enabled:
            raise WorkerFailure(f"fatal worker error: {result.error.message}")
        outputs = core.apply_result(scheduler_output, result)
        if self.tracing is not None:
            self.tracing.on_step_landed(scheduler_output.step_id)
        while core.step_grammars:  # the next step's masks waited for this one (async)
            await self.workers.send_grammar(core.step_grammars.pop(0))
        return outputs

    def _traced_turn_away(self, rejected: RequestRejected) -> None:
        if self.tracing is not None:
            self.tracing.end(rejected.request_id, f"{rejected.code}: {rejected.message}")

    def _abandon_in_flight(self) -> None:
        """Stop waiting for the steps sent (``EngineCore.fail_all`` abandons them too)."""
        while self._in_flight:
            self.workers.forget(self._in_flight.popleft()[1])
        self._busy = False
        if self.tracing is not None:
            self.tracing.abandon_steps("the step was abandoned (a fault)")

    # ----- outputs

    def stats(self) -> SchedulerStats | None:
        """The engine core's stats with this shell's step timing (None: no core yet)."""
        return self.core.stats(self.timing) if self.core is not None else None

    async def _publish(self, outputs: ClientOutputs) -> None:
        """Publish a core call's outputs (and send what it queued for the KV tier and the
        prefill engine cores whose held KV it is done with)."""
        if self.offload is not None:
            self.offload.flush()
        if self.core is not None:
            for prefill_engine_id, request_ids in self.core.take_kv_releases().items():
                await self._release_kv(prefill_engine_id, request_ids)
        if self.tracing is not None:
            self.tracing.on_outputs(outputs)
        stats = self.stats()
        now = time.time()
        for client_id, client_outputs in outputs.items():
            await self._send(client_id, EngineOutputs(self.engine_id, client_outputs, now, stats))
        if self.kv_events is not None:  # once per step, like the outputs
            await self.kv_events.publish(self.core, self.incarnation)

    async def _release_kv(self, prefill_engine_id: str, request_ids: list[str]) -> None:
        """Tell a prefill engine core it may free the KV it holds for these requests (a lost
        release is logged: the hold's lease frees it later)."""
        subject = self.subjects.engine_in(prefill_engine_id)
        try:
            await self.bus.publish(subject, encode(ReleaseKV(request_ids)))
        except BusError as exc:
            log.warning(
                "engine %s: KV release to %s lost: %r", self.engine_id, prefill_engine_id, exc
            )

    async def _send(self, client_id: str, message: EngineOutputs | RequestRejected) -> None:
        try:
            await self.bus.publish(self.subjects.engine_out(client_id), encode(message))
        except BusError:
            log.exception("engine %s: output to client %s lost", self.engine_id, client_id)

    async def _publish_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.core is None or (not force and now - self._last_stats_time < self.stats_interval_s):
            return
        self._last_stats_time = now
        stats = EngineStats(
            self.engine_id,
            self.core.stats(self.timing),
            time.time(),
            max_model_len=self.max_model_len,
            num_blocks=self.num_blocks,
            block_size=self.config.cache_config.block_size,
            incarnation=self.incarnation,
            kv_tier_id=self.offload.config.cpu_tier_id if self.offload is not None else "",
            kv_role=self.kv_role,
        )
        try:
            await self.bus.publish(self.subjects.engine_stats(self.engine_id), encode(stats))
        except BusError as exc:
            log.debug("engine %s: stats not published: %r", self.engine_id, exc)
