"""``SchedulerStats``, built here and nowhere else: what an engine core publishes for load-aware
routing and metrics (requests running and waiting, KV usage, prefix-cache hits, finishes by
reason, steps in flight, the offload connector's, disaggregated prefill's and speculative
decoding's own counters, and the shell's step timing).

Each figure is read from the part that owns it: the scheduler, the ``EngineCore`` around it
(inputs not applied yet, steps in flight), the connector, speculative decoding, and
``StepTiming``, which only the shell can measure (it waits on the workers) and hands in.
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass
from typing import Protocol, TypedDict

from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.messages.worker import StepResult
from shoal.engine.core.adapter_limit import LoRAReport
from shoal.engine.core.kv_cache_manager import KVCacheManager
from shoal.engine.core.kv_handover import KVHandovers
from shoal.engine.core.offload_connector import OffloadConnector
from shoal.engine.core.remote_prefill import RemotePrefills
from shoal.engine.core.spec_decoding import SpecDecoding


@dataclass(slots=True)
class StepTiming:
    """The shell's step timing (cumulative): wall time from sending a step to having its
    result, the workers' own execute time, the steps landed, and the workers' idle time
    between steps while the engine core had work."""

    step_wall_s: float = 0.0
    worker_execute_s: float = 0.0
    num_worker_steps: int = 0
    worker_idle_s: float = 0.0

    def count(self, wall_s: float, result: StepResult, count_idle: bool) -> None:
        """A step's result came back ``wall_s`` after it was sent (``count_idle``: the worker
        waited for it while this engine core had work)."""
        self.step_wall_s += wall_s
        self.worker_execute_s += result.execute_time_s
        self.num_worker_steps += 1
        if count_idle:
            self.worker_idle_s += result.idle_before_s


class CountingScheduler(Protocol):
    """What the stats are read from (``engine.core.scheduler.Scheduler``), read only."""

    @property
    def running(self) -> Sized: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_manager(self) -> KVCacheManager: ...
    @property
    def num_finished(self) -> dict[str, int]: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_generation_tokens(self) -> int: ...
    @property
    def step_id(self) -> int: ...
    @property
    def connector(self) -> OffloadConnector | None: ...
    @property
    def spec(self) -> SpecDecoding | None: ...
    @property
    def handovers(self) -> KVHandovers: ...
    @property
    def remote_prefills(self) -> RemotePrefills: ...
    def lora_report(self) -> LoRAReport | None: ...


@dataclass(frozen=True, slots=True)
class CoreFigures:
    """What the ``EngineCore`` around a scheduler adds: adds queued but not applied (they wait
    too), the steps in flight now and the most seen at once, every token scheduled."""

    num_pending_adds: int = 0
    num_steps_in_flight: int = 0
    most_steps_in_flight: int = 0
    num_scheduled_tokens: int = 0


def scheduler_stats(
    scheduler: CountingScheduler,
    core: CoreFigures | None = None,
    timing: StepTiming | None = None,
) -> SchedulerStats:
    """The stats of ``scheduler`` (a bare one: no ``core`` figures, no ``timing``)."""
    core = core or CoreFigures()
    timing = timing or StepTiming()
    kv = scheduler.kv_cache_manager
    finished = scheduler.num_finished
    return SchedulerStats(
        num_running=len(scheduler.running),
        num_waiting=scheduler.num_waiting + core.num_pending_adds,
        kv_usage=kv.usage,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions,
        num_prompt_tokens=scheduler.num_prompt_tokens,
        num_generation_tokens=scheduler.num_generation_tokens,
        step_id=scheduler.step_id,
        step_wall_s=timing.step_wall_s,
        worker_execute_s=timing.worker_execute_s,
        num_worker_steps=timing.num_worker_steps,
        num_finished_stop=finished["stop"],
        num_finished_length=finished["length"],
        num_finished_abort=finished["abort"],
        num_finished_error=finished["error"],
        num_free_blocks=kv.num_free_blocks,
        worker_idle_s=timing.worker_idle_s,
        num_steps_in_flight=core.num_steps_in_flight,
        max_steps_in_flight=core.most_steps_in_flight,
        num_scheduled_tokens=core.num_scheduled_tokens,
        **_offload_fields(scheduler.connector),
        **_spec_fields(scheduler.spec),
        **_handover_fields(scheduler.handovers, scheduler.remote_prefills),
        **_lora_fields(scheduler.lora_report()),
    )


class _LoRAFields(TypedDict, total=False):
    lora_running: list[str]
    lora_waiting: list[str]
    lora_resident: list[str]
    max_loras: int


def _lora_fields(report: LoRAReport | None) -> _LoRAFields:
    if report is None:
        return {}
    return {
        "lora_running": report.running,
        "lora_waiting": report.waiting,
        "lora_resident": report.resident,
        "max_loras": report.max_loras,
    }


class _OffloadFields(TypedDict, total=False):
    kv_offload_queries: int
    kv_offload_hits: int
    kv_offload_load_bytes: int
    kv_offload_load_time_s: float
    kv_offload_store_bytes: int
    kv_offload_store_time_s: float
    kv_offload_stores_skipped: int
    kv_offload_lookup_failures: int
    kv_offload_cpu_usage: float


class _HandoverFields(TypedDict):
    kv_handover_holds: int
    kv_handover_released: int
    kv_handover_expired: int
    kv_handover_holding: int
    kv_pulls: int
    kv_pull_failures: int
    kv_pulled_tokens: int
    kv_pull_recomputed_tokens: int
    kv_pull_bytes: int
    kv_pull_time_s: float
    kv_pull_late: int


class _SpecFields(TypedDict, total=False):
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: list[int]
    spec_decode_k: int


def _offload_fields(connector: OffloadConnector | None) -> _OffloadFields:
    if connector is None:
        return {}
    counters = connector.counters
    return {
        "kv_offload_queries": counters.num_queried_tokens,
        "kv_offload_hits": counters.num_hit_tokens,
        "kv_offload_load_bytes": counters.num_load_bytes,
        "kv_offload_load_time_s": counters.load_time_s,
        "kv_offload_store_bytes": counters.num_store_bytes,
        "kv_offload_store_time_s": counters.store_time_s,
        "kv_offload_stores_skipped": connector.stores.num_skipped,
        "kv_offload_lookup_failures": counters.num_lookup_failures,
        "kv_offload_cpu_usage": connector.cpu_usage,
    }


def _spec_fields(spec: SpecDecoding | None) -> _SpecFields:
    if spec is None:
        return {}
    return {
        "spec_decode_num_drafts": spec.num_drafts,
        "spec_decode_num_draft_tokens": spec.num_draft_tokens,
        "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
        "spec_decode_num_accepted_tokens_per_pos": list(spec.num_accepted_tokens_per_pos),
        "spec_decode_k": spec.k,
    }


def _handover_fields(handovers: KVHandovers, remote_prefills: RemotePrefills) -> _HandoverFields:
    pulls = remote_prefills.counters
    return {
        "kv_handover_holds": handovers.num_held,
        "kv_handover_released": handovers.num_released,
        "kv_handover_expired": handovers.num_expired,
        "kv_handover_holding": handovers.num_holding,
        "kv_pulls": pulls.num_pulls,
        "kv_pull_failures": pulls.num_failed_pulls,
        "kv_pulled_tokens": pulls.num_pulled_tokens,
        "kv_pull_recomputed_tokens": pulls.num_recomputed_tokens,
        "kv_pull_bytes": pulls.num_pull_bytes,
        "kv_pull_time_s": pulls.pull_time_s,
        "kv_pull_late": pulls.num_late,
    }
