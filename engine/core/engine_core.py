"""The engine core's synchronous heart: the scheduler plus its pending inputs, with no I/O.

``EngineCoreActor`` (``engine/actor/core_actor.py``) is the thin async shell: it feeds inputs in,
asks for a step, sends it to the workers and hands the result back. Keeping this part pure
leaves room for the later wrappers: a fault-tolerance sentinel around ``step`` sits in the shell.

Steps in flight: every non-empty step ``schedule()`` returns is outstanding until its result is
applied; results must come back strictly in step order (``ValueError`` otherwise). One step may be
outstanding, two with ``async_scheduling`` (the shell then schedules step N+1 while N runs).
``fail_all`` also abandons the outstanding steps.

Inputs are queued as they arrive and applied all together before each step; aborts are also
applied just before a step's results (so a request aborted mid-step gets no more tokens), once
the step has landed (so the blocks of a request in no other step in flight are freed at once).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

from shoal.bus.messages.engine import (
    AbortRequest,
    AddRequest,
    EngineCoreOutput,
    ReleaseKV,
    RequestRejected,
    SchedulerStats,
)
from shoal.bus.messages.kv_events import KVEvent, snapshot_events
from shoal.bus.messages.kv_handover import KVExportRef
from shoal.bus.messages.structured import StepGrammar
from shoal.bus.messages.worker import StepResult, WorkerInfo
from shoal.config.deployment import CacheConfig, SchedulerConfig, ShoalConfig
from shoal.config.kv_transfer import KVTransferConfig
from shoal.config.lora import LoRAConfig
from shoal.config.speculative import SpeculativeConfig
from shoal.engine.core.grammar import GrammarBackend, late_grammar
from shoal.engine.core.offload_port import OffloadPort
from shoal.engine.core.request import (
    ClientOutputs,
    Request,
    RequestStatus,
    group_final_outputs,
    merge_outputs,
)
from shoal.engine.core.scheduler import Scheduler
from shoal.engine.core.scheduler_output import SchedulerOutput
from shoal.engine.core.scheduler_stats import CoreFigures, StepTiming, scheduler_stats

log = logging.getLogger(__name__)


def kv_cache_shape(config: ShoalConfig, infos: Sequence[WorkerInfo]) -> tuple[int, int]:
    """(KV blocks, context length) of an engine core whose workers reported ``infos``: a
    configured block count wins over the smallest worker's; the context is the smallest of the
    workers' and the configured one."""
    num_blocks = config.cache_config.num_gpu_blocks_override or min(i.num_blocks for i in infos)
    max_model_len = min(i.max_model_len for i in infos)
    if config.model_config.max_model_len:
        max_model_len = min(max_model_len, config.model_config.max_model_len)
    return num_blocks, max_model_len


class EngineCore:
    """A scheduler with an input queue, admission control and failure handling."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        num_blocks: int,
        max_model_len: int,
        kv_transfer_config: KVTransferConfig | None = None,
        speculative_config: SpeculativeConfig | None = None,
        grammar_backend: GrammarBackend | None = None,
        kv_handover_lease_s: float | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """``kv_handover_lease_s``: how long prompt KV held for a remote decode waits to be
        pulled (None: vLLM's 480 s)."""
        self.scheduler = Scheduler(
            scheduler_config,
            cache_config,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            kv_transfer_config=kv_transfer_config,
            speculative_config=speculative_config,
            grammar_backend=grammar_backend,
            lora_config=lora_config,
        )
        if kv_handover_lease_s is not None:
            self.scheduler.handovers.lease_s = kv_handover_lease_s
        self.max_waiting_requests = scheduler_config.max_waiting_requests
        self.max_steps_in_flight = 2 if scheduler_config.async_scheduling else 1
        self.outstanding: deque[SchedulerOutput] = deque()  # steps sent, oldest first
        self._inputs: deque[AddRequest | AbortRequest | ReleaseKV] = deque()
        self._pending_aborts: set[str] = set()
        self._num_pending_adds = 0
        # Late masks of steps in flight (``grammar.late_grammar``), for the shell to send.
        self.step_grammars: list[StepGrammar] = []
        self._late_grammar_step = -1  # the last step they were made for
        connector = self.scheduler.connector
        # The offload link's door (None: no KV offload).
        self.offload = OffloadPort(connector, self.scheduler.unpark) if connector else None
        self.most_steps_in_flight = 0
        self.num_scheduled_tokens = 0  # every token of every step scheduled (cumulative)

    # ----- inputs (called as messages arrive)

    def admit(self, msg: AddRequest) -> RequestRejected | None:
        """Queue an add, or say why not (``overloaded`` past the waiting bound)."""
        num_waiting = self.scheduler.num_waiting + self._num_pending_adds
        if num_waiting >= self.max_waiting_requests:
            self.turn_away(msg)
            return RequestRejected(
                msg.request_id,
                "overloaded",
                f"engine queue is full ({num_waiting} requests waiting)",
            )
        self._inputs.append(msg)
        self._num_pending_adds += 1
        return None

    def queue_abort(self, msg: AbortRequest) -> None:
        self._inputs.append(msg)
        self._pending_aborts.update(msg.request_ids)

    def queue_release(self, msg: ReleaseKV) -> None:
        """Prompt KV held for these requests' remote decodes may go (applied with the inputs)."""
        self._inputs.append(msg)

    @property
    def has_inputs(self) -> bool:
        return bool(self._inputs)

    def has_work(self) -> bool:
        return bool(self._inputs or self.outstanding) or self.scheduler.has_requests()

    @property
    def can_schedule(self) -> bool:
        """Room for one more step in flight."""
        return len(self.outstanding) < self.max_steps_in_flight

    # ----- the step

    def apply_inputs(self) -> tuple[ClientOutputs, list[tuple[str, RequestRejected]]]:
        """Apply every queued add, abort and KV release in arrival order, then end the KV holds
        whose lease ran out. A resumed request already at its end finishes here (its final
        output, no new tokens)."""
        outputs: ClientOutputs = {}
        rejected: list[tuple[str, RequestRejected]] = []
        while self._inputs:
            msg = self._inputs.popleft()
            match msg:
                case AddRequest():
                    self._num_pending_adds -= 1
                    result = self._add(msg)
                    if isinstance(result, RequestRejected):
                        rejected.append((msg.client_id, result))
                    elif result is not None:
                        outputs.setdefault(msg.client_id, []).append(result)
                case AbortRequest():
                    merge_outputs(outputs, self.scheduler.abort(msg.request_ids))
                case ReleaseKV():
                    self.scheduler.handovers.release(msg.request_ids)
        self._pending_aborts.clear()
        self.scheduler.handovers.expire(time.monotonic())
        merge_outputs(outputs, group_final_outputs(self.scheduler.admit_compiled()))
        return outputs, rejected

    def _add(self, msg: AddRequest) -> RequestRejected | EngineCoreOutput | None:
        """None once queued; the rejection, or the final output of a resumed request already
        at its end."""
        request = Request.from_add(msg)
        try:
            queued = self.scheduler.add_request(request)
        except ValueError as exc:
            self.turn_away(msg)
            return RequestRejected(msg.request_id, "invalid", str(exc))
        return None if queued else request.make_final_output()

    def schedule(self) -> SchedulerOutput | None:
        """The next step, or None when there is nothing to run. A non-empty step is outstanding
        until its result is applied; ``RuntimeError`` past ``max_steps_in_flight``."""
        if not self.can_schedule:
            raise RuntimeError(
                f"{len(self.outstanding)} steps already in flight "
                f"(at most {self.max_steps_in_flight}): apply a result first"
            )
        if not self.scheduler.has_requests():
            return None
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.is_empty:
            self._make_outstanding(scheduler_output)
        return scheduler_output

    def _make_outstanding(self, scheduler_output: SchedulerOutput) -> None:
        self.outstanding.append(scheduler_output)
        self.most_steps_in_flight = max(self.most_steps_in_flight, len(self.outstanding))
        self.num_scheduled_tokens += scheduler_output.total_num_scheduled_tokens

    def hold_dummy(self, scheduler_output: SchedulerOutput | None) -> SchedulerOutput:
        """The step to send when this rank has no tokens but its lock-step group runs a round
        (``engine/core/lockstep.py``): ``scheduler_output`` (what ``schedule`` gave, perhaps
        None or empty), made outstanding like any step so its result lands in order."""
        if scheduler_output is not None and scheduler_output.total_num_scheduled_tokens:
            raise ValueError(f"step {scheduler_output.step_id} has tokens: not a dummy")
        if scheduler_output is None:  # nothing to run; it may still carry KV copies by now
            scheduler_output = self.scheduler.schedule()
            self._make_outstanding(scheduler_output)
        elif scheduler_output.is_empty:  # a non-empty one is outstanding already
            self._make_outstanding(scheduler_output)
        return scheduler_output

    def apply_result(self, scheduler_output: SchedulerOutput, result: StepResult) -> ClientOutputs:
        """Land the oldest outstanding step with its result (``Scheduler.update_from_output``,
        which also finishes the aborts that arrived during the step). ``ValueError`` unless
        this is the oldest outstanding step and ``result`` is its own."""
        if not self.outstanding or self.outstanding[0] is not scheduler_output:
            expected = self.outstanding[0].step_id if self.outstanding else None
            raise ValueError(
                f"result for step {scheduler_output.step_id} applied out of order "
                f"(next outstanding step: {expected})"
            )
        outputs = self.scheduler.update_from_output(scheduler_output, result, self._pending_aborts)
        self._pending_aborts.clear()
        self.outstanding.popleft()
        self._make_late_grammar(result)
        return outputs

    def _make_late_grammar(self, landed: StepResult) -> None:
        """The masks of the next step in flight, if they waited for the step just landed."""
        grammars = self.scheduler.grammars
        if not self.outstanding or grammars is None:
            return
        following = self.outstanding[0]
        if following.grammar_later and following.step_id != self._late_grammar_step:
            backend, requests = grammars.backend, self.scheduler.requests
            drafts = dict(zip(landed.req_ids, landed.spec_token_ids, strict=False))
            self.step_grammars.append(late_grammar(backend, following, requests, drafts))
            self._late_grammar_step = following.step_id

    def fail_all(self, reason: str, resumable: bool = False) -> ClientOutputs:
        """Finish every request with an error (the workers lost their state) and forget the
        prefix cache, whose blocks no longer hold what their hashes say. Outstanding steps are
        abandoned: their results, if they come, are not applied. ``resumable``: the fault is the
        engine core's, not the requests' (a client may resume them elsewhere)."""
        while self.outstanding:
            abandoned = self.outstanding.popleft()
            if abandoned.grammar_later and abandoned.step_id != self._late_grammar_step:
                self.step_grammars.append(StepGrammar(abandoned.step_id))  # no wait for masks
            self.scheduler.land_step(abandoned, wrote_kv=False)
        if self.scheduler.connector is not None:
            self.scheduler.connector.abandon()
        requests = list(self.scheduler.requests.values())
        for request in requests:
            request.error = reason
        finished = self.scheduler.finish_requests(None, RequestStatus.FINISHED_ERROR)
        self.scheduler.finished_req_ids.clear()
        self.scheduler.preempted_req_ids.clear()
        self.scheduler.handovers.release_all()  # the KV they held is not trusted either
        self.scheduler.remote_prefills.abandon()  # (their prefill sides are released)
        if not self.scheduler.reset_prefix_cache():
            log.error("prefix cache not reset after a failure: blocks still in use")
        outputs = group_final_outputs(finished)
        if resumable:
            for client_outputs in outputs.values():
                for output in client_outputs:
                    output.resumable = True
        return outputs

    # ----- disaggregated prefill

    def set_kv_source(self, engine_id: str, exports: list[KVExportRef]) -> None:
        """Where this engine core's held prompt KV can be pulled from: its workers' exported
        caches, one per rank in rank order (none: a decode side recomputes)."""
        self.scheduler.handovers.set_source(engine_id, exports)

    def turn_away(self, msg: AddRequest) -> None:
        """An add refused (here, or by the shell for its own reason): the KV a remote prefill
        holds for it may go."""
        self.scheduler.remote_prefills.release_unadded(msg.request_id, msg.kv_transfer_params)

    def take_kv_releases(self) -> dict[str, list[str]]:
        """Prefill engine core → the requests whose held KV it may free (pulled, failed or no
        longer needed), since the last call."""
        return self.scheduler.remote_prefills.take_releases()

    # ----- KV events (prefix routing; ``engine/actor/kv_events_link.py``)

    def take_kv_events(self, restart: bool = False) -> list[KVEvent] | None:
        """What entered and left the prefix cache since the last call (None: no prefix
        caching, nothing to tell). ``restart``: the log starts now (the caller publishes a
        snapshot instead)."""
        kv = self.scheduler.kv_cache_manager
        events_log = kv.record_kv_events() if restart else kv.block_pool.kv_events
        return events_log.take() if events_log is not None else None

    def kv_snapshot(self) -> list[KVEvent]:
        """The events that rebuild this prefix cache from nothing."""
        kv = self.scheduler.kv_cache_manager
        return snapshot_events(kv.block_pool.cached_hashes(), kv.block_size)

    def stats(self, timing: StepTiming | None = None) -> SchedulerStats:
        """This engine core's stats (``timing``: the shell's, which only it measures)."""
        figures = CoreFigures(
            num_pending_adds=self._num_pending_adds,
            num_steps_in_flight=len(self.outstanding),
            most_steps_in_flight=self.most_steps_in_flight,
            num_scheduled_tokens=self.num_scheduled_tokens,
        )
        return scheduler_stats(self.scheduler, figures, timing)
