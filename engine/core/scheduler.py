"""The scheduler: which requests run each step, with how many tokens (vLLM V1's algorithm).

One token-budget model, no prefill phase: every request has ``num_computed_tokens`` catching up
with its tokens. Each ``schedule()``:

1. serves **running** requests in order, each up to its missing tokens (chunked by the budget,
   ``long_prefill_token_threshold`` and ``max_model_len``); when blocks run out it **preempts**
   (FCFS: the last running; priority: the highest (priority, arrival)) until the allocation fits,
   the victim is the request itself, or the victim's blocks must wait for a step in flight (the
   request then waits a step). A victim frees its blocks, goes to the **front** of the
   waiting queue and is recomputed from token 0 (its cached blocks usually make that cheap);
2. only if nothing was preempted this step, admits **waiting** requests while the budget,
   ``max_num_seqs`` and free blocks allow, taking prefix-cache hits first; a waiting request that
   does not fit stops admission (no preemption from the waiting loop);
   a request resumed after a fault (it arrives with outputs) is admitted like a preempted one:
   prompt + outputs recomputed, prefix-cache hits taken on both;
3. advances ``num_computed_tokens`` optimistically and returns the step as a diff.

``update_from_output`` reads the step's result into a ``StepOutcome`` (``step_outcome.py``:
tokens appended with stop checks, per-client outputs, none for a partial prefill) and applies it:
frees stopped requests, finishes those a failed step names with FINISHED_ERROR (forgetting their
cached hashes), preempts scheduled requests the result does not mention (recomputed from 0), and
counts tokens. ``finish_requests`` aborts (idempotent).

Async scheduling (``SchedulerConfig.async_scheduling``) uses this same code: step N+1 may be
scheduled before N's result lands. A request scheduled to sample books an output placeholder
(``Request.num_output_placeholders``), counted as a known token, so it is scheduled again at once;
it is skipped once its tokens plus placeholders reach ``max_tokens`` or ``max_model_len`` (each
request runs exactly ``prompt + max_tokens - 1`` tokens). ``land_step`` (the start of applying a
result, steps strictly in order) ends the step's flight; ``InFlightSteps`` (``in_flight.py``)
keeps the blocks of a request that finishes or is preempted while a step that may write them is
in flight until that step lands, and ignores the stale outputs of a preempted request. Blocks
are cached only once the step that fills them has landed (not at allocation, so no later step
can hit KV that is not written yet).
With one step in flight at a time the placeholder and in-flight counts are zero whenever
``schedule()`` runs, and blocks are cached at allocation as before, so nothing changes.

KV offload (``offload_connector.py``): admission asks the connector after the local prefix-cache
lookup (parking a request while it is looked up); landing hands it the step's copies and chunks.
Disaggregated prefill: a request prefilled elsewhere pulls its prompt's KV at admission instead
(``remote_prefill.py``); a request prefilled here for a decode elsewhere has its prompt's KV
held when it ends capped by ``max_tokens`` (``kv_handover.py``).

Speculative decoding (``spec_decoding.py``): a request that samples verifies its drafts as extra
scheduled tokens; the landing rolls back the rejected ones. Structured outputs: ``grammar.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.messages.worker import StepResult
from shoal.config.deployment import CacheConfig, SchedulerConfig
from shoal.config.kv_transfer import KVTransferConfig
from shoal.config.lora import LoRAConfig
from shoal.config.speculative import SpeculativeConfig
from shoal.engine.core import grammar
from shoal.engine.core.adapter_limit import (
    AdapterLimit,
    LoRAReport,
    ResidentAdapters,
    adapter_names,
)
from shoal.engine.core.block_hash import BlockHasher
from shoal.engine.core.in_flight import InFlightSteps, PendingFree
from shoal.engine.core.kv_cache_manager import KVCacheManager
from shoal.engine.core.kv_handover import KVHandovers
from shoal.engine.core.offload_connector import Admission, OffloadConnector
from shoal.engine.core.remote_prefill import RemotePrefills
from shoal.engine.core.request import (
    FINISH_REASONS,
    ClientOutputs,
    Request,
    RequestStatus,
    group_final_outputs,
    merge_outputs,
)
from shoal.engine.core.request_limits import check_fits, check_token_budget
from shoal.engine.core.request_queue import make_request_queue
from shoal.engine.core.scheduler_output import SchedulerOutput, StepPlan, build_scheduler_output
from shoal.engine.core.scheduler_stats import scheduler_stats
from shoal.engine.core.spec_decoding import SpecDecoding
from shoal.engine.core.step_outcome import StepOutcome, make_step_outcome
from shoal.engine.core.stop_check import check_stop

RUNNING = RequestStatus.RUNNING
PREEMPTED = RequestStatus.PREEMPTED


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        max_model_len: int,
        num_blocks: int | None = None,
        kv_transfer_config: KVTransferConfig | None = None,
        speculative_config: SpeculativeConfig | None = None,
        grammar_backend: grammar.GrammarBackend | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """``max_model_len`` and ``num_blocks`` are what the workers reported (the block
        count defaults to ``cache_config.num_gpu_blocks_override``). ``kv_transfer_config``
        with a connector: KV offload (``offload_connector.py``); ``speculative_config`` with
        a method: speculative decoding (``spec_decoding.py``); ``grammar_backend``: structured
        outputs (``grammar.py``; without one a request with a grammar is refused);
        ``lora_config`` with ``enable_lora``: requests with adapters, at most ``max_loras``
        distinct ones among the running requests (a worker's slots)."""
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        num_blocks = num_blocks or cache_config.num_gpu_blocks_override
        if num_blocks is None:
            raise ValueError(
                "num_gpu_blocks is not known yet: size the KV cache or set an override"
            )
        check_token_budget(scheduler_config, max_model_len)
        self.num_blocks = num_blocks
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            self.block_size,
            cache_config.enable_prefix_caching,
            # With async scheduling a block is cached only once the step filling it is back.
            cache_on_allocation=not scheduler_config.async_scheduling,
        )
        self.block_hasher: BlockHasher | None = (
            BlockHasher(self.block_size, cache_config.prefix_caching_hash_algo)
            if cache_config.enable_prefix_caching
            else None
        )
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []
        self.finished_req_ids: list[str] = []  # for the worker, sent with the next step
        self.preempted_req_ids: list[str] = []  # likewise (recovered from a failed step)
        self.step_id = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompts of requests that got their first token
        self.num_generation_tokens = 0
        self.num_finished = dict.fromkeys(FINISH_REASONS.values(), 0)  # by finish reason
        self._reserved_blocks = int(scheduler_config.watermark * num_blocks)
        # Output placeholders a sampling request books per step: none when results always land
        # before the next schedule() (then the counts stay zero), one with async scheduling.
        self.num_placeholders_per_step = 1 if scheduler_config.async_scheduling else 0
        self.in_flight = InFlightSteps(self.kv_cache_manager)
        # Prompt KV held for remote decodes (disaggregated prefill).
        self.handovers = KVHandovers(self.kv_cache_manager.block_pool, self.block_size)
        # Prompt KV pulled from remote prefills (the decode side of disaggregation).
        self.remote_prefills = RemotePrefills(self.block_size)
        self.connector: OffloadConnector | None = None
        if kv_transfer_config is not None and kv_transfer_config.enabled:
            if not cache_config.enable_prefix_caching:
                raise ValueError(
                    "KV offload needs enable_prefix_caching (its keys are block hashes)"
                )
            self.connector = OffloadConnector(
                kv_transfer_config, self.block_size, self.kv_cache_manager.block_pool
            )
        self.spec: SpecDecoding | None = None
        if speculative_config is not None and speculative_config.enabled:
            max_num_seqs = scheduler_config.max_num_seqs
            self.spec = SpecDecoding(speculative_config, max_num_seqs, max_model_len)
        self.grammars = grammar.GrammarParking(grammar_backend) if grammar_backend else None
        self.max_loras = (
            lora_config.max_loras if lora_config is not None and lora_config.enable_lora else 0
        )
        self.resident_adapters = ResidentAdapters(self.max_loras)

    # ----- requests in and out

    def add_request(self, request: Request) -> bool:
        """Queue a request. ``ValueError`` if its id is taken or it could never fit.

        False when a request resumed after a fault is already done (at ``max_tokens`` or
        ``max_model_len``, or its last token stops it): it is finished at once, with its
        status set, and not queued; the caller publishes its final output."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.lora_request is not None and not self.max_loras:
            raise ValueError(
                f"request asks for LoRA adapter {request.lora_request.lora_name!r} but this "
                "engine core serves no adapters (--enable-lora)"
            )
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        check_fits(
            request,
            max_model_len=self.max_model_len,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            reserved=self._reserved_blocks,
        )
        if request.num_resumed_tokens and check_stop(request, self.max_model_len):
            self.num_finished[FINISH_REASONS[request.status]] += 1
            # (nothing to pull any more)
            self.remote_prefills.release_unadded(request.request_id, request.remote_prefill)
            return False
        if self.block_hasher is not None and not request.has_block_hasher:
            request.set_block_hasher(self.block_hasher)
        if grammar.grammar_bound(request):
            if self.grammars is None:
                raise ValueError("structured outputs are not available on this engine core")
            self.grammars.park(request)  # queued once its grammar is compiled
        else:
            self.waiting.add(request)
        self.requests[request.request_id] = request
        self.remote_prefills.track(request)
        return True

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, status: RequestStatus
    ) -> list[Request]:
        """Finish these requests (None: all) with ``status``; unknown or finished ids are skipped.

        Returns the requests actually finished, so the caller can publish their final outputs
        (``Request.make_final_output``, grouped by ``request.group_final_outputs``).
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a finished status, got {status}")
        if request_ids is None:
            request_ids = list(self.requests)
        elif isinstance(request_ids, str):
            request_ids = [request_ids]
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self.finish_request(request, status)
            finished.append(request)
        return finished

    def finish_request(
        self, request: Request, status: RequestStatus, drop_cached: bool = False
    ) -> None:
        """Take a queued or running request off its queue and release it with ``status``."""
        if request.status is RUNNING:
            self.running.remove(request)
        elif not (self.grammars is not None and self.grammars.unpark(request)):
            self.waiting.remove(request)
        was_on_worker = request.status is RUNNING
        request.status = status
        self.release_finished(request, was_on_worker, drop_cached)

    def release_finished(
        self, request: Request, was_on_worker: bool, drop_cached: bool = False
    ) -> None:
        """Free a finished request's blocks and forget it (it is already off the queues)."""
        self.in_flight.free(request, drop_cached)
        if self.connector is not None:
            self.connector.forget(request)
        self.remote_prefills.forget(request)
        if self.grammars is not None:
            self.grammars.release(request)
        self.num_finished[FINISH_REASONS[request.status]] += 1
        if was_on_worker:
            self.finished_req_ids.append(request.request_id)
        del self.requests[request.request_id]

    def has_requests(self) -> bool:
        """Work to do: unfinished requests, finished/preempted ids the worker must drop, or KV
        offload copies to send."""
        return bool(
            self.requests
            or self.finished_req_ids
            or self.preempted_req_ids
            or (self.connector is not None and self.connector.has_pending_transfers())
        )

    @property
    def num_waiting(self) -> int:
        """Queued, parked while their KV is looked up, or while their grammar compiles."""
        num_parked = len(self.connector.parked) if self.connector else 0
        return len(self.waiting) + num_parked + (len(self.grammars) if self.grammars else 0)

    def admit_compiled(self) -> list[Request]:
        """Queue the requests whose grammar compiled; finish and return those it failed for."""
        if self.grammars is None:
            return []
        return self.grammars.admit(self.waiting.reinsert, self.release_finished)

    def unpark(self, request: Request | None) -> None:
        """A request whose KV lookup ended goes back to the waiting queue, in arrival order."""
        if request is not None and self.requests.get(request.request_id) is request:
            self.waiting.reinsert(request)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.kv_cache_manager.get_block_ids(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (refused while a block is in use, a held one included)."""
        return self.kv_cache_manager.reset_prefix_cache()

    # ----- one step

    def schedule(self) -> SchedulerOutput:
        self.step_id += 1
        plan = StepPlan(self.scheduler_config.token_budget)
        threshold = self.scheduler_config.long_prefill_token_threshold
        if len(self.running) + len(self.waiting) <= 1:
            threshold = 0  # a lone request may take the whole budget
        self._schedule_running(plan, threshold)
        if not plan.preempted:
            self._schedule_waiting(plan, threshold)
        if self.max_loras:
            scheduled = (self.requests[r] for r in plan.num_scheduled)
            self.resident_adapters.note_step(adapter_names(scheduled))
        return self._make_output(plan)

    def lora_report(self) -> LoRAReport | None:
        """The adapters running, waiting and held in the workers' slots (None: no LoRA)."""
        if not self.max_loras:
            return None
        return LoRAReport(
            adapter_names(self.running),
            adapter_names(self.waiting),
            self.resident_adapters.names,
            self.max_loras,
        )

    def _schedule_running(self, plan: StepPlan, threshold: int) -> None:
        running, spec = self.running, self.spec
        allocate_slots = self.kv_cache_manager.allocate_slots
        max_model_len = self.max_model_len
        budget = plan.token_budget
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            index += 1
            num_computed = request.num_computed_tokens
            num_known = len(request.all_token_ids) + request.num_output_placeholders
            if request.num_output_placeholders and (
                num_known - request.num_prompt_tokens >= request.max_tokens
                or num_known >= max_model_len
            ):
                continue  # its last token is already scheduled (async scheduling)
            num_new = num_known - num_computed
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new > max_model_len - num_computed:
                num_new = max_model_len - num_computed
            if num_new <= 0:
                continue
            num_slots = num_new
            num_spec = 0
            if spec is not None and num_computed + num_new == num_known:  # it samples
                num_spec = spec.num_drafts_to_verify(request, num_known, budget - num_new)
                if num_spec and self.grammars is not None:  # only drafts its grammar accepts
                    num_spec = self.grammars.num_valid_drafts(request, num_spec)
                num_slots += num_spec + spec.num_lookahead(request, num_known + num_spec)
            new_block_ids = allocate_slots(request, num_slots)
            while new_block_ids is None:
                victim_index = self._victim_index()
                victim = running.pop(victim_index)
                if victim_index < index:
                    index -= 1
                budget += self._unschedule(plan, victim)
                self.preempt(victim)
                plan.preempted.append(victim.request_id)
                if victim is request or self.in_flight.is_pending(victim):
                    break  # (its blocks come back when its in-flight step lands)
                new_block_ids = allocate_slots(request, num_slots)
            if new_block_ids is None:
                break
            plan.num_scheduled[request.request_id] = num_new + num_spec
            if num_spec:
                plan.num_spec[request.request_id] = num_spec
            plan.cached.append(request)
            plan.cached_block_ids.append(new_block_ids)
            budget -= num_new + num_spec
        plan.token_budget = budget

    def _victim_index(self) -> int:
        """FCFS: the last running. Priority: the highest (priority, arrival), the later in the
        running list on a tie, so two equal requests never take turns preempting the one ahead
        (each recomputing more than it advances)."""
        running = self.running
        if self.scheduler_config.scheduling_policy == "fcfs":
            return len(running) - 1
        return max(
            range(len(running)), key=lambda i: (running[i].priority, running[i].arrival_time, i)
        )

    @staticmethod
    def _unschedule(plan: StepPlan, victim: Request) -> int:
        """Take back a victim already scheduled this step; returns its tokens to refund."""
        num_tokens = plan.num_scheduled.pop(victim.request_id, 0)
        plan.num_spec.pop(victim.request_id, None)
        if num_tokens:
            position = plan.cached.index(victim)
            del plan.cached[position]
            del plan.cached_block_ids[position]
        return num_tokens

    def preempt(self, request: Request) -> None:
        """Free the request's blocks and queue it first, to be recomputed from token 0; the
        outputs of its steps in flight become stale."""
        self.in_flight.free(request)
        request.status = PREEMPTED
        request.num_computed_tokens = 0
        request.num_stale_steps = request.num_in_flight_steps
        request.num_in_flight_tokens = 0
        request.num_output_placeholders = 0
        request.spec_token_ids.clear()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _schedule_waiting(self, plan: StepPlan, threshold: int) -> None:
        config = self.scheduler_config
        waiting, running = self.waiting, self.running
        kv, connector = self.kv_cache_manager, self.connector
        remote_prefills = self.remote_prefills
        budget = plan.token_budget
        loras = AdapterLimit(self.max_loras, running)
        while waiting and budget > 0 and len(running) < config.max_num_seqs:
            request = waiting.peek()
            if not loras.admits(request):
                loras.skip(waiting.pop())  # its adapter would need one slot too many
                continue
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            remote = remote_prefills.on_admission(request, len(hits))
            external = (
                connector.on_admission(request, len(hits)) if connector and not remote else None
            )
            if external is Admission.PARK:
                waiting.pop()  # waits for its lookup; the requests behind it go on
                continue
            num_external_tokens = external.num_blocks * self.block_size if external else 0
            if remote is not None:
                num_external_tokens = remote.num_tokens
            num_new = num_missing = request.num_tokens - num_hit_tokens - num_external_tokens
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                if not config.enable_chunked_prefill:
                    break
                num_new = budget
            num_slots = num_new
            if self.spec is not None and num_new == num_missing:  # it samples: draft-model room
                num_slots += self.spec.num_lookahead(request, request.num_tokens)
            new_block_ids = kv.allocate_slots(
                request,
                num_slots,
                hits,
                full_sequence_must_fit=config.scheduler_reserve_full_isl,
                # The watermark is room for running requests to grow into: with none running
                # it is waived, or a victim longer than usable - watermark would wait forever.
                reserved_blocks=self._reserved_blocks if running else 0,
                num_external_tokens=num_external_tokens,
            )
            if new_block_ids is None:
                break
            waiting.pop()
            plan.new.append((request, request.is_resumed))
            request.status = RUNNING
            request.num_computed_tokens = num_hit_tokens + num_external_tokens
            if connector is not None:
                connector.on_admitted(request, external, new_block_ids)
            if remote is not None:
                remote_prefills.on_admitted(request, remote, new_block_ids)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
                request.first_scheduled_time = time.time()
                kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            running.append(request)
            loras.admitted(request)
            plan.num_scheduled[request.request_id] = num_new
            budget -= num_new
        plan.token_budget = budget
        loras.requeue(waiting)

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        finished, self.finished_req_ids = self.finished_req_ids, []
        preempted, self.preempted_req_ids = self.preempted_req_ids + plan.preempted, []
        output = build_scheduler_output(
            self.step_id,
            plan,
            self.kv_cache_manager.get_block_ids,
            finished,
            preempted,
            self.num_placeholders_per_step,
        )
        if self.connector is not None:
            output.kv_transfers = self.connector.build_transfers(self.step_id)
        output.kv_pulls = self.remote_prefills.build(self.step_id)
        if self.grammars is not None and self.grammars.num_active:  # (before drafts go -1)
            grammar.plan_grammar(self.grammars.backend, output)
        if self.spec is not None:
            self.spec.after_schedule(output)
        return output

    # ----- results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, result: StepResult, aborted: Iterable[str] = ()
    ) -> ClientOutputs:
        """Land the step (the one place a step lands) and apply its result; returns the
        outputs to publish. ``aborted``: requests whose abort arrived while the step ran:
        finished once it has landed (so their blocks are freed at once) and before its tokens
        count (they get none), or, after a failed step, once that step's failures are applied
        (they finish with the step's error and forget the KV it was to write)."""
        if result.step_id != scheduler_output.step_id:
            raise ValueError(
                f"result is for step {result.step_id}, expected {scheduler_output.step_id}"
            )
        skipped = self.land_step(scheduler_output)
        if result.error is not None:
            outputs = self._apply_result(scheduler_output, result, skipped)
            return merge_outputs(outputs, self.abort(aborted))
        outputs = self.abort(aborted)
        return merge_outputs(outputs, self._apply_result(scheduler_output, result, skipped))

    def abort(self, request_ids: Iterable[str]) -> ClientOutputs:
        """Finish these requests as aborted (those still here); their final outputs."""
        request_ids = list(request_ids)
        if not request_ids:
            return {}
        return group_final_outputs(
            self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        )

    def _apply_result(
        self, scheduler_output: SchedulerOutput, result: StepResult, skipped: set[str]
    ) -> ClientOutputs:
        """A landed step's tokens, copies and grammar advances."""
        outcome = make_step_outcome(
            self.requests, scheduler_output, result, self.max_model_len, skipped, self.spec
        )
        loaded: list[str] = []
        if self.connector is not None:
            if result.kv_transfer is not None:
                self.connector.counters.count_copies(result.kv_transfer)
            fatal = result.error is not None and result.error.fatal
            copies = None if fatal else result.kv_transfer
            table = self.kv_cache_manager.req_to_blocks
            loaded = self.connector.on_landed(scheduler_output, copies, outcome, skipped, table)
        if scheduler_output.kv_pulls:
            fatal = result.error is not None and result.error.fatal
            copies = None if fatal else result.kv_transfer
            loaded += self.remote_prefills.on_landed(scheduler_output.step_id, copies)
        if self.grammars is not None and self.grammars.num_active:
            grammar.advance_matchers(self.grammars.backend, self.requests, outcome)
        self._apply_outcome(outcome)  # (a failed load's blocks were never cached)
        self.in_flight.cache_landed(scheduler_output)
        for request_id in loaded:  # KV loaded or pulled: now it may be cached
            request = self.requests.get(request_id)
            if request is not None and request.status is RUNNING:
                self.kv_cache_manager.cache_blocks(request, request.num_landed_tokens)
        return outcome.outputs

    def land_step(self, scheduler_output: SchedulerOutput, wrote_kv: bool = True) -> set[str]:
        """End the step's flight (``InFlightSteps.land``, idempotent): returns the ids whose
        output to ignore. Called directly only for a step abandoned with its result unknown
        (``wrote_kv=False``); a result lands through ``update_from_output``."""
        return self.in_flight.land(scheduler_output, self.requests, wrote_kv)

    @property
    def pending_frees(self) -> dict[Request, list[PendingFree]]:
        """Blocks of finished or preempted requests waiting for a step in flight."""
        return self.in_flight.pending_frees

    def _apply_outcome(self, outcome: StepOutcome) -> None:
        """Free stopped requests, finish failed ones, preempt unreported ones, count tokens."""
        stopped = outcome.stopped
        if stopped:
            for request in stopped:
                if request.hands_kv_over and request.status is RequestStatus.FINISHED_LENGTH_CAPPED:
                    self._hold_for_remote_decode(request, outcome)
                self.release_finished(request, was_on_worker=True)
            self.running = [r for r in self.running if r.status is RUNNING]
        for request in outcome.failed:
            # The step's KV for these requests may be garbage: forget their cached hashes.
            self.finish_request(request, RequestStatus.FINISHED_ERROR, drop_cached=True)
        for request, num_unrun_tokens in outcome.to_recompute:
            request.num_computed_tokens -= num_unrun_tokens  # so their blocks are not cached
            self.running.remove(request)
            self.preempt(request)
            self.preempted_req_ids.append(request.request_id)
        self.num_prompt_tokens += outcome.num_prompt_tokens
        self.num_generation_tokens += outcome.num_generation_tokens

    def _hold_for_remote_decode(self, request: Request, outcome: StepOutcome) -> None:
        """Hold a finished prefill's prompt KV for its decode side, and say where in its final
        output (the last of its outputs this step)."""
        blocks = self.kv_cache_manager.req_to_blocks.get(request.request_id, [])
        params = self.handovers.hold(
            request.request_id,
            blocks,
            request.num_prompt_tokens,
            request.num_landed_tokens,
            time.monotonic(),
        )
        for output in reversed(outcome.outputs.get(request.client_id, [])):
            if output.request_id == request.request_id:
                output.kv_transfer_params = params
                return

    def make_stats(self) -> SchedulerStats:
        return scheduler_stats(self)


__all__ = ["FINISH_REASONS", "Request", "RequestStatus", "Scheduler", "SchedulerOutput"]
