"""``gateway.tiering_metrics``: the KV offload tiers' heartbeat counters as
``vllm:kv_offload_tiering_*`` per tier, cumulative figures turned into increments, a restarted
tier (new incarnation) counted from zero, an out-of-order beat ignored, the CPU tier's and a
secondary tier's names both read."""

from __future__ import annotations

from shoal.bus.messages.control import ActorState, Heartbeat
from shoal.gateway.metrics import Metrics

PREFIX = "vllm:kv_offload_tiering_"


def beat(tier: str, seq: int, life: str, **load: float) -> Heartbeat:
    return Heartbeat(tier, "tier", seq, ActorState.READY, 0.0, load, life)


def sample(metrics: Metrics, name: str, tier: str) -> float | None:
    labels = {"model_name": "m", "tier": tier}
    return metrics.registry.get_sample_value(f"{PREFIX}{name}_total", labels)


def test_counters_grow_by_the_heartbeats_increments_per_tier() -> None:
    metrics = Metrics("m")
    metrics.tiering.update_tier(beat("kv-cpu", 1, "a", num_queries=4, num_hits=1))
    metrics.tiering.update_tier(beat("kv-cpu", 2, "a", num_queries=10, num_hits=3))
    metrics.tiering.update_tier(beat("kv-cpu", 1, "a", num_queries=2))  # late: ignored
    assert sample(metrics, "chunk_queries", "kv-cpu") == 10
    assert sample(metrics, "chunk_hits", "kv-cpu") == 3
    metrics.tiering.update_tier(beat("kv-cpu", 1, "b", num_queries=5))  # restarted
    assert sample(metrics, "chunk_queries", "kv-cpu") == 15
    metrics.tiering.update_tier(beat("kv-cpu", 3, "a", num_queries=11))  # the old life, late
    metrics.tiering.update_tier(beat("kv-cpu", 2, "b", num_queries=6))
    assert sample(metrics, "chunk_queries", "kv-cpu") == 16


def test_a_secondary_tiers_figures_and_the_cpu_tiers_drops_for_it() -> None:
    metrics = Metrics("m")
    secondary = {"num_chunks_stored": 6, "num_chunks_loaded": 2, "num_store_failures": 1,
                 "num_load_failures": 1, "num_chunks_corrupt": 2,
                 "num_chunks_dropped": 3}  # fmt: skip
    metrics.tiering.update_tier(beat("kv-cpu-fs0", 1, "a", **secondary))
    cpu = {"num_queries": 9, "num_cascaded": 6, "backpressure_dropped:kv-cpu-fs0": 4}
    metrics.tiering.update_tier(beat("kv-cpu", 1, "a", **cpu))
    names = ("cascades", "promotions", "cascade_failures", "promotion_failures",
             "backpressure_dropped_stores", "chunk_queries")  # fmt: skip
    assert {name: sample(metrics, name, "kv-cpu-fs0") for name in names} == {
        "cascades": 6, "promotions": 2, "cascade_failures": 1, "promotion_failures": 3,
        "backpressure_dropped_stores": 7, "chunk_queries": None,
    }  # fmt: skip
    assert sample(metrics, "cascades", "kv-cpu") is None  # counted once, by the secondary
    assert PREFIX + "cascades_total" in metrics.render().decode()
