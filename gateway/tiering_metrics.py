"""The KV offload tiers' own counters on ``/metrics`` (vLLM's ``vllm:kv_offload_tiering_*``),
per tier: the CPU tier's lookups and hits, and for every tier the chunks promoted (loaded) and
cascaded (stored), those that failed, and stores dropped for backpressure.

Tier actors report cumulative counters in their heartbeats' ``load`` (``Heartbeat.load``); a
tier that restarted (a new incarnation) starts from zero again, so its first figures count as
fresh increments. The CPU tier and a secondary tier name their counters differently: each
series reads the first name a tier's figures have.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from shoal.bus.messages.control import Heartbeat
from shoal.gateway.spec_decode_metrics import increment

# (metric, help, the figures that feed it: the CPU tier's, then a secondary tier's)
TIERING_COUNTERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("vllm:kv_offload_tiering_chunk_queries", "Chunks looked up in the tier", ("num_queries",)),
    ("vllm:kv_offload_tiering_chunk_hits", "Chunks the tier held when looked up", ("num_hits",)),
    (
        "vllm:kv_offload_tiering_promotions",
        "Chunks promoted (loaded) from a lower tier or read by a secondary",
        ("num_promoted", "num_chunks_loaded"),
    ),
    (
        "vllm:kv_offload_tiering_promotion_failures",
        "Chunks whose promotion failed",
        ("num_promote_failures", "num_load_failures"),
    ),
    (
        "vllm:kv_offload_tiering_cascades",
        "Chunks cascaded (stored) to a secondary tier",
        ("num_cascaded", "num_chunks_stored"),
    ),
    (
        "vllm:kv_offload_tiering_cascade_failures",
        "Chunks whose cascade failed",
        ("num_cascade_failures", "num_store_failures"),
    ),
    (
        "vllm:kv_offload_tiering_backpressure_dropped_stores",
        "Chunk stores dropped because a tier was too slow or its queue full",
        ("num_backpressure_dropped", "num_chunks_dropped"),
    ),
)


class TieringMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name", "tier"]
        self.counters = [
            (Counter(name, doc, labels, registry=registry), sources)
            for name, doc, sources in TIERING_COUNTERS
        ]
        self._last: dict[str, Heartbeat] = {}  # tier id → its last heartbeat counted

    def update_tier(self, beat: Heartbeat) -> None:
        """A tier actor's heartbeat: its counters' growth since the last one."""
        last = self._last.get(beat.actor_id)
        if last is not None and (last.incarnation != beat.incarnation or beat.seq < last.seq):
            if last.incarnation == beat.incarnation:
                return  # an older beat, out of order
            last = None  # a restarted tier counts from zero
        for counter, sources in self.counters:
            source = next((s for s in sources if s in beat.load), None)
            if source is None:
                continue
            previous = last.load.get(source, 0.0) if last is not None else 0.0
            counter.labels(self.model_name, beat.actor_id).inc(
                increment(beat.load[source], previous)
            )
        self._last[beat.actor_id] = beat
