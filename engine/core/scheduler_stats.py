"""``SchedulerStats`` of a scheduler: what it publishes for load-aware routing and metrics
(requests running and waiting, KV usage, prefix-cache hits, finishes by reason, the offload
connector's and speculative decoding's own counters)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.bus.messages.engine import SchedulerStats

if TYPE_CHECKING:
    from shoal.engine.core.scheduler import Scheduler


def scheduler_stats(scheduler: Scheduler) -> SchedulerStats:
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
