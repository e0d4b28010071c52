"""The KV offload tiers' own counters on ``/metrics`` (vLLM's ``vllm:kv_offload_tiering_*``),
per tier (label ``tier``): the CPU tier's chunk lookups and hits; each secondary tier's chunks
read by promotions and written by cascades, those that failed (a damaged or missing chunk
too), and its stores dropped, by its own full queue or by the CPU tier's backpressure on it
(which the CPU tier reports per secondary).

Tier actors report cumulative counters in their heartbeats' ``load`` (``Heartbeat.load``); a
tier that restarted (a new incarnation) starts from zero again, so its first figures count as
fresh increments, and late beats of its earlier life are ignored.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from shoal.bus.messages.control import Heartbeat
from shoal.gateway.spec_decode_metrics import increment

# (metric, help, the figures of a tier's heartbeat summed into it)
TIERING_COUNTERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("vllm:kv_offload_tiering_chunk_queries", "Chunks looked up in the tier", ("num_queries",)),
    ("vllm:kv_offload_tiering_chunk_hits", "Chunks the tier held when looked up", ("num_hits",)),
    ("vllm:kv_offload_tiering_promotions", "Chunks read by a promotion", ("num_chunks_loaded",)),
    (
        "vllm:kv_offload_tiering_promotion_failures",
        "Chunks a promotion could not read (an error, or missing or damaged)",
        ("num_load_failures", "num_chunks_corrupt"),
    ),
    ("vllm:kv_offload_tiering_cascades", "Chunks written by a cascade", ("num_chunks_stored",)),
    (
        "vllm:kv_offload_tiering_cascade_failures",
        "Chunks a cascade could not write",
        ("num_store_failures",),
    ),
    (
        "vllm:kv_offload_tiering_backpressure_dropped_stores",
        "Chunk stores dropped: the tier's queue was full, or the CPU tier found it too slow",
        ("num_chunks_dropped",),
    ),
)
# The CPU tier reports its backpressure drops per secondary as ``<prefix><secondary id>``.
PER_SECONDARY_DROPPED = "backpressure_dropped:"
DROPPED = TIERING_COUNTERS[-1][0]


class TieringMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name", "tier"]
        self.counters = {
            name: (Counter(name, doc, labels, registry=registry), sources)
            for name, doc, sources in TIERING_COUNTERS
        }
        self._last: dict[str, Heartbeat] = {}  # tier id → its last heartbeat counted
        self._retired: dict[str, set[str]] = {}  # tier id → incarnations it restarted from

    def update_tier(self, beat: Heartbeat) -> None:
        """A tier actor's heartbeat: its counters' growth since the last one counted."""
        last = self._last.get(beat.actor_id)
        if last is not None and last.incarnation != beat.incarnation:
            retired = self._retired.setdefault(beat.actor_id, set())
            if beat.incarnation in retired:
                return  # a late beat of an earlier life
            retired.add(last.incarnation)
            last = None  # a restarted tier counts from zero
        elif last is not None and beat.seq < last.seq:
            return  # an older beat, out of order
        for counter, sources in self.counters.values():
            if any(source in beat.load for source in sources):
                self._add(counter, beat.actor_id, beat, last, sources)
        for figure in beat.load:
            if figure.startswith(PER_SECONDARY_DROPPED):
                dropped = self.counters[DROPPED][0]
                self._add(dropped, figure[len(PER_SECONDARY_DROPPED) :], beat, last, (figure,))
        self._last[beat.actor_id] = beat

    def _add(
        self,
        counter: Counter,
        tier: str,
        beat: Heartbeat,
        last: Heartbeat | None,
        sources: tuple[str, ...],
    ) -> None:
        value = sum(beat.load.get(source, 0.0) for source in sources)
        previous = sum(last.load.get(source, 0.0) for source in sources) if last else 0.0
        counter.labels(self.model_name, tier).inc(increment(value, previous))
