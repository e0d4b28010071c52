"""``SchedulerStats`` of a scheduler: what it publishes for load-aware routing and metrics
(requests running and waiting, KV usage, prefix-cache hits, finishes by reason, the offload
connector's and speculative decoding's own counters)."""

from __future__ import annotations

from collections.abc import Sized
from typing import Protocol

from shoal.bus.messages.engine import SchedulerStats
from shoal.engine.core.kv_cache_manager import KVCacheManager
from shoal.engine.core.offload_connector import OffloadConnector
from shoal.engine.core.spec_decoding import SpecDecoding


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


def scheduler_stats(scheduler: CountingScheduler) -> SchedulerStats:
    kv = scheduler.kv_cache_manager
    finished = scheduler.num_finished
    stats = SchedulerStats(
        num_running=len(scheduler.running),
        num_waiting=scheduler.num_waiting,
        kv_usage=kv.usage,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions,
        num_prompt_tokens=scheduler.num_prompt_tokens,
        num_generation_tokens=scheduler.num_generation_tokens,
        step_id=scheduler.step_id,
        num_finished_stop=finished["stop"],
        num_finished_length=finished["length"],
        num_finished_abort=finished["abort"],
        num_finished_error=finished["error"],
        num_free_blocks=kv.num_free_blocks,
    )
    if scheduler.connector is not None:
        scheduler.connector.fill_stats(stats)
    if scheduler.spec is not None:
        scheduler.spec.fill_stats(stats)
    return stats
