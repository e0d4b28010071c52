"""``gateway.metrics.Metrics``: the KV offload figures of ``SchedulerStats`` on ``/metrics``
under vLLM's names, per engine core, cumulative counters turned into increments."""

from __future__ import annotations

import re

from shoal.bus.messages.engine import SchedulerStats
from shoal.gateway.metrics import Metrics

FIELDS = {  # SchedulerStats field → the series it is exposed as
    "kv_offload_queries": "vllm:kv_offload_queries_total",
    "kv_offload_hits": "vllm:kv_offload_hits_total",
    "kv_offload_load_bytes": "vllm:kv_offload_load_bytes_total",
    "kv_offload_load_time_s": "vllm:kv_offload_load_time_total",
    "kv_offload_store_bytes": "vllm:kv_offload_store_bytes_total",
    "kv_offload_store_time_s": "vllm:kv_offload_store_time_total",
    "kv_offload_stores_skipped": "vllm:kv_offload_stores_skipped_total",
    "kv_offload_lookup_failures": "shoal:kv_offload_lookup_failures_total",
}
USAGE = "vllm:kv_offload_cpu_cache_usage_perc"


def _stats(step: int, scale: float, usage: float = 0.0) -> SchedulerStats:
    """Stats whose i-th offload counter is ``(i + 1) * scale``."""
    figures = {f: type(getattr(SchedulerStats(), f))((i + 1) * scale) for i, f in enumerate(FIELDS)}
    return SchedulerStats(step_id=step, kv_offload_cpu_usage=usage, **figures)


def _samples(text: str, engine: str) -> dict[str, float]:
    """``name → value`` of the series labelled with ``engine`` in a text exposition."""
    found: dict[str, float] = {}
    for name, labels, value in re.findall(r"^([\w:]+)\{([^}]*)\} (\S+)$", text, re.M):
        if f'engine="{engine}"' in labels and 'model_name="m"' in labels:
            found[name] = float(value)
    return found


def test_offload_counters_and_usage_in_the_exposition_per_engine() -> None:
    metrics = Metrics("m")
    metrics.update_engine_stats(_stats(1, 10, usage=0.25), "e0")
    metrics.update_engine_stats(_stats(2, 30, usage=0.5), "e0")  # cumulative: 30 per unit
    metrics.update_engine_stats(_stats(1, 1, usage=0.125), "e1")
    text = metrics.render().decode()
    e0, e1 = _samples(text, "e0"), _samples(text, "e1")
    for i, series in enumerate(FIELDS.values()):
        assert e0[series] == (i + 1) * 30, series
        assert e1[series] == (i + 1) * 1, series
        assert f"# TYPE {series} counter" in text  # this exposition types the _total name
    assert (e0[USAGE], e1[USAGE]) == (0.5, 0.125)
    assert f"# TYPE {USAGE} gauge" in text


def test_offload_counters_count_a_restarted_core_afresh() -> None:
    metrics = Metrics("m")
    metrics.update_engine_stats(_stats(10, 100), "e0")
    metrics.update_engine_stats(_stats(2, 5), "e0")  # the core restarted: its counters fell
    e0 = _samples(metrics.render().decode(), "e0")
    assert e0["vllm:kv_offload_hits_total"] == 2 * 100 + 2 * 5
    assert e0["vllm:kv_offload_load_time_total"] == 4 * 100 + 4 * 5


def test_offload_series_are_zero_for_a_core_without_offload() -> None:
    metrics = Metrics("m")
    assert "kv_offload" not in "".join(_samples(metrics.render().decode(), "e0"))
    metrics.update_engine_stats(SchedulerStats(num_running=1, step_id=1), "e0")
    e0 = _samples(metrics.render().decode(), "e0")
    assert {e0[s] for s in (*FIELDS.values(), USAGE)} == {0.0}


DISAGG_FIELDS = {  # disaggregated prefill's SchedulerStats fields → their series
    "kv_handover_holds": "shoal:kv_handover_holds_total",
    "kv_handover_released": "shoal:kv_handover_released_total",
    "kv_handover_expired": "shoal:kv_handover_expired_total",
    "kv_pulls": "shoal:kv_pulls_total",
    "kv_pull_failures": "vllm:nixl_num_failed_transfers_total",
    "kv_pulled_tokens": "shoal:kv_pulled_tokens_total",
    "kv_pull_recomputed_tokens": "shoal:kv_pull_recomputed_tokens_total",
    "kv_pull_bytes": "shoal:kv_pull_bytes_total",
    "kv_pull_time_s": "shoal:kv_pull_seconds_total",
    "kv_pull_late": "shoal:kv_pull_late_total",
}


def test_disaggregation_counters_and_holds_in_the_exposition() -> None:
    metrics = Metrics("m")
    for step, scale in ((1, 2), (2, 7)):
        figures = {
            f: type(getattr(SchedulerStats(), f))((i + 1) * scale)
            for i, f in enumerate(DISAGG_FIELDS)
        }
        stats = SchedulerStats(step_id=step, kv_handover_holding=3 * step, **figures)
        metrics.update_engine_stats(stats, "p0")
    p0 = _samples(metrics.render().decode(), "p0")
    for i, series in enumerate(DISAGG_FIELDS.values()):
        assert p0[series] == (i + 1) * 7, series
    assert p0["shoal:kv_handover_holding"] == 6
