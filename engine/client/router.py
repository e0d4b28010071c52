"""Which engine core takes the next request: the engine cores this client has heard from, their
last published load, and this client's own requests in flight on each.

An engine core counts as ready while its heartbeats or stats keep arriving (``stale_after_s``)
and its last state is READY. The least loaded ready one wins: waiting + running requests as last
reported, plus what this client sent since (not yet in a report), ties broken by KV usage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shoal.bus.messages.control import ActorState
from shoal.bus.messages.engine import EngineStats


@dataclass(slots=True)
class EngineView:
    engine_id: str
    stats: EngineStats
    seen_at: float
    state: ActorState = ActorState.READY
    num_sent_since_stats: int = 0

    def score(self) -> tuple[float, float]:
        s = self.stats.stats
        return (s.num_waiting + s.num_running + self.num_sent_since_stats, s.kv_usage)


class EngineRouter:
    def __init__(self, stale_after_s: float = 10.0) -> None:
        self.stale_after_s = stale_after_s
        self.engines: dict[str, EngineView] = {}

    def on_stats(self, stats: EngineStats, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        view = self.engines.get(stats.engine_id)
        if view is None:
            self.engines[stats.engine_id] = EngineView(stats.engine_id, stats, now)
            return
        view.stats, view.seen_at, view.num_sent_since_stats = stats, now, 0

    def on_state(self, engine_id: str, state: ActorState, now: float | None = None) -> None:
        """A heartbeat or status event: the engine core is alive, in ``state``."""
        view = self.engines.get(engine_id)
        if view is not None:
            view.state = state
            view.seen_at = time.monotonic() if now is None else now

    def is_ready(self, view: EngineView, now: float) -> bool:
        return view.state is ActorState.READY and now - view.seen_at <= self.stale_after_s

    def ready_engines(self, now: float | None = None) -> list[EngineView]:
        now = time.monotonic() if now is None else now
        return [v for v in self.engines.values() if self.is_ready(v, now)]

    def pick(self, now: float | None = None) -> EngineView | None:
        ready = self.ready_engines(now)
        if not ready:
            return None
        best = min(ready, key=EngineView.score)
        best.num_sent_since_stats += 1
        return best

    def max_model_len(self) -> int | None:
        lens = [v.stats.max_model_len for v in self.engines.values() if v.stats.max_model_len]
        return min(lens) if lens else None

    def lost_engines(self, now: float | None = None) -> list[str]:
        """Engines that stopped, died or went silent (their requests will never finish)."""
        now = time.monotonic() if now is None else now
        return [
            v.engine_id
            for v in self.engines.values()
            if v.state in (ActorState.DEAD, ActorState.STOPPED)
            or now - v.seen_at > 2 * self.stale_after_s
        ]
