"""Which engine core takes the next request: the engine cores this client has heard from, their
last published load, and this client's own requests in flight on each.

An engine core is known once its stats arrive. It counts as ready while its heartbeats or stats
keep arriving (``stale_after_s``) and its last state (``bus.runtime.liveness``) is READY; it counts
as lost once DEAD or STOPPED or silent for twice that. Its ``epoch`` counts its restarts (new
incarnations): a request sent in an earlier epoch died with the process that had it. The least
loaded ready one wins: waiting + running requests as last reported, plus what this client sent
since (not yet in a report), ties broken by KV usage.

Prefix-aware routing (``mode="kv"``, with a ``prefix_index.PrefixIndex`` fed by the engine
cores' and KV tiers' events): given a request's chained block hashes, the ready engine core with
the best ``cached prefix blocks + TIER_BLOCK_WEIGHT * further blocks in its CPU tier -
load_weight * load`` wins (``kv_score``): the blocks its device cache holds count whole; those
after them that the CPU tier it loads from (``EngineStats.kv_tier_id``, medium "cpu") holds
count ``TIER_BLOCK_WEIGHT``, a copy over the host's memory being far cheaper than recomputing
them but not free. Ties go to the least loaded, as in load mode, which is also what a request
without full blocks gets. Before scoring, the index drops the entries of an incarnation the
liveness table knows to be over.

A pick counts ``num_requests`` toward the engine core's load: a request with ``n`` > 1 sends
``n`` engine requests there.

LoRA affinity: a request with an adapter prefers an engine core whose workers hold it in a slot
(``SchedulerStats.lora_resident``): there it costs no slot write and evicts no other adapter.
Holding it is worth ``LORA_AFFINITY`` requests of load (and as many cached blocks in kv mode),
so a busier engine core that holds it still loses to a much idler one.

Disaggregated prefill: each engine core reports its role (``EngineStats.kv_role``). A pick
names the roles it takes: requests go to ``both`` and ``decode`` engine cores, remote prefills
to ``prefill`` ones (``disagg_routing.DisaggRouting`` decides which requests); a ``prefill``
engine core takes other requests only while no other is ready.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.bus.messages.control import ActorState
from shoal.bus.messages.engine import EngineStats
from shoal.bus.runtime.liveness import GONE_STATES, LivenessTable
from shoal.engine.client.prefix_index import PrefixIndex


@dataclass(slots=True)
class EngineView:
    engine_id: str
    stats: EngineStats
    num_sent_since_stats: int = 0

    @property
    def load(self) -> int:
        """Requests queued or running there, as last reported plus sent since."""
        s = self.stats.stats
        return s.num_waiting + s.num_running + self.num_sent_since_stats

    def score(self) -> tuple[float, float]:
        return (self.load, self.stats.stats.kv_usage)

    @property
    def role(self) -> str:
        return self.stats.kv_role


SERVING_ROLES = ("both", "decode")  # the engine cores a request goes to
PREFILL_ROLES = ("prefill",)  # those a remote prefill goes to


# What a block its host's CPU tier holds is worth, against one its device cache holds (1) and
# one it recomputes (0): loading it is a copy from host memory, far faster than a prefill of its
# tokens, but not free (the copy, and the lookup's round trip before the request is scheduled).
TIER_BLOCK_WEIGHT = 0.5

# What an engine core holding a request's adapter is worth, in requests of load (load mode) or
# cached blocks (kv mode).
LORA_AFFINITY = 2.0


def adapter_bonus(view: EngineView, lora_name: str | None) -> float:
    """``LORA_AFFINITY`` if ``view``'s workers hold the adapter ``lora_name``, else 0."""
    if lora_name is None or lora_name not in view.stats.stats.lora_resident:
        return 0.0
    return LORA_AFFINITY


def kv_score(
    num_cached_blocks: int, load: float, load_weight: float, num_tier_blocks: int = 0
) -> float:
    """An engine core's worth for a request in kv mode (higher is better): its device-cached
    leading blocks, plus ``num_tier_blocks`` further leading blocks its CPU tier holds."""
    return num_cached_blocks + TIER_BLOCK_WEIGHT * num_tier_blocks - load_weight * load


def _load_key(view: EngineView, lora_name: str | None) -> tuple[float, float]:
    load, kv_usage = view.score()
    return (load - adapter_bonus(view, lora_name), kv_usage)


class EngineRouter:
    """Engine views by id; ``liveness`` is fed with the engine cores' heartbeats and status
    events (``bus.runtime.liveness.watch_liveness``) and touched by their stats."""

    def __init__(
        self,
        stale_after_s: float = 10.0,
        *,
        index: PrefixIndex | None = None,
        load_weight: float = 1.0,
    ) -> None:
        self.stale_after_s = stale_after_s
        self.engines: dict[str, EngineView] = {}
        self.liveness = LivenessTable()
        self.index = index  # kv mode when set
        self.load_weight = load_weight
        self.num_prefix_routed = 0  # picks that went where some prefix was cached
        self.num_prefix_blocks = 0  # cached prefix blocks of the picked engine cores, summed

    def on_stats(self, stats: EngineStats, now: float | None = None) -> bool:
        """Take an engine core's stats; False if ignored (sent by a retired incarnation)."""
        if not self.liveness.touch(stats.engine_id, now, incarnation=stats.incarnation):
            return False
        view = self.engines.get(stats.engine_id)
        if view is None:
            self.engines[stats.engine_id] = EngineView(stats.engine_id, stats)
        else:
            view.stats, view.num_sent_since_stats = stats, 0
        return True

    def epoch(self, engine_id: str) -> int:
        """How many times this engine core restarted, as far as this client knows."""
        return self.liveness.num_restarts(engine_id)

    def is_ready(self, engine_id: str, now: float | None = None) -> bool:
        peer = self.liveness.get(engine_id)
        return (
            peer is not None
            and peer.state is ActorState.READY
            and self.liveness.is_fresh(engine_id, self.stale_after_s, now)
        )

    def ready_engines(
        self, now: float | None = None, roles: Sequence[str] | None = None
    ) -> list[EngineView]:
        """The ready engine cores (of ``roles``, when given)."""
        now = time.monotonic() if now is None else now
        return [
            v
            for v in self.engines.values()
            if self.is_ready(v.engine_id, now) and (roles is None or v.role in roles)
        ]

    def pick(
        self,
        now: float | None = None,
        exclude: str | None = None,
        block_hashes: Sequence[bytes] = (),
        num_requests: int = 1,
        roles: Sequence[str] = SERVING_ROLES,
        lora_name: str | None = None,
    ) -> EngineView | None:
        """The ready engine core of ``roles`` (other than ``exclude``) for a request whose
        chained block hashes are ``block_hashes`` (kv mode; else the least loaded) and whose
        adapter is ``lora_name``, counted as sent ``num_requests`` more (the engine requests it
        makes: its ``n``). For a request (``SERVING_ROLES``) with none of them ready, any ready
        engine core will do."""
        ready = [v for v in self.ready_engines(now, roles) if v.engine_id != exclude]
        if not ready and roles == SERVING_ROLES:
            ready = [v for v in self.ready_engines(now) if v.engine_id != exclude]
        return self.choose(ready, block_hashes, num_requests, lora_name)

    def choose(
        self,
        views: Sequence[EngineView],
        block_hashes: Sequence[bytes] = (),
        num_requests: int = 1,
        lora_name: str | None = None,
    ) -> EngineView | None:
        """``pick``'s choice among ``views`` (None if there are none), counted as sent."""
        if not views:
            return None
        if self.index is None or not block_hashes:
            best = min(views, key=lambda v: _load_key(v, lora_name))
        else:
            best = self._best_prefix(views, block_hashes, lora_name)
        best.num_sent_since_stats += num_requests
        return best

    def num_cached_blocks(self, engine_id: str, block_hashes: Sequence[bytes]) -> int:
        """The leading blocks of ``block_hashes`` cached on ``engine_id`` (kv mode; else 0)."""
        if self.index is None or not block_hashes:
            return 0
        return self.index.num_cached_blocks(engine_id, block_hashes)

    def _best_prefix(
        self, ready: Sequence[EngineView], block_hashes: Sequence[bytes], lora_name: str | None
    ) -> EngineView:
        index = self.index
        assert index is not None
        for view in ready:  # a new life whose snapshot is late holds nothing known yet
            peer = self.liveness.get(view.engine_id)
            if peer is not None:
                index.follow_incarnation(view.engine_id, peer.incarnation, peer.retired)
        cached = {v.engine_id: index.num_cached_blocks(v.engine_id, block_hashes) for v in ready}
        in_tier = {v.engine_id: self._num_tier_blocks(v, block_hashes, cached) for v in ready}

        def key(view: EngineView) -> tuple[float, float, float]:
            load = view.load
            score = kv_score(
                cached[view.engine_id], load, self.load_weight, in_tier[view.engine_id]
            )
            score += adapter_bonus(view, lora_name)
            return (-score, load, view.stats.stats.kv_usage)

        best = min(ready, key=key)
        if cached[best.engine_id]:
            self.num_prefix_routed += 1
            self.num_prefix_blocks += cached[best.engine_id]
        return best

    def _num_tier_blocks(
        self, view: EngineView, block_hashes: Sequence[bytes], cached: dict[str, int]
    ) -> int:
        """The leading blocks after the device-cached ones that ``view``'s CPU tier holds."""
        tier_id, num_cached = view.stats.kv_tier_id, cached[view.engine_id]
        if not tier_id or self.index is None:
            return 0
        held = self.index.num_cached_blocks(tier_id, block_hashes, "cpu", start=num_cached)
        return held - num_cached

    def max_model_len(self) -> int | None:
        lens = [v.stats.max_model_len for v in self.engines.values() if v.stats.max_model_len]
        return min(lens) if lens else None

    def is_lost(self, engine_id: str, now: float | None = None) -> bool:
        """Stopped, dead or silent: its requests will never finish."""
        peer = self.liveness.get(engine_id)
        if peer is None or peer.state in GONE_STATES:
            return True
        return not self.liveness.is_fresh(engine_id, 2 * self.stale_after_s, now)

    def lost_engines(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [engine_id for engine_id in self.engines if self.is_lost(engine_id, now)]
