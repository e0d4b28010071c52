"""The gateway process's periodic stats log: for each engine core, every ``interval_s`` (10 s,
vLLM's default), speculative decoding's figures over the interval in vLLM's words
(``SpecDecodingLogging``), when the deployment speculates and drafts were verified.

``SpecDecodingInterval`` is the arithmetic, from two snapshots of an engine core's cumulative
counters: mean acceptance length = 1 + accepted / drafts, per-position acceptance rate =
accepted at position i / drafts, draft acceptance rate = accepted / draft tokens. ``StatsLogger``
keeps the snapshot each interval starts from and logs when a report arrives past its end (so an
engine core with no reports logs nothing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from shoal.bus.messages.engine import SchedulerStats
from shoal.gateway.spec_decode_metrics import increment

log = logging.getLogger(__name__)
LOG_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class SpecDecodingInterval:
    """What one engine core's speculation did between two reports."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]
    elapsed_s: float

    @classmethod
    def between(
        cls, before: SchedulerStats, after: SchedulerStats, elapsed_s: float
    ) -> SpecDecodingInterval:
        """The figures ``after`` adds to ``before`` (a drop: the core restarted, and ``after``
        counts from zero)."""
        per_pos_before = before.spec_decode_num_accepted_tokens_per_pos
        per_pos_after = after.spec_decode_num_accepted_tokens_per_pos
        per_pos = tuple(
            int(increment(v, per_pos_before[i] if i < len(per_pos_before) else 0))
            for i, v in enumerate(per_pos_after)
        )
        return cls(
            num_drafts=int(increment(after.spec_decode_num_drafts, before.spec_decode_num_drafts)),
            num_draft_tokens=int(
                increment(after.spec_decode_num_draft_tokens, before.spec_decode_num_draft_tokens)
            ),
            num_accepted_tokens=int(
                increment(
                    after.spec_decode_num_accepted_tokens, before.spec_decode_num_accepted_tokens
                )
            ),
            accepted_per_pos=per_pos,
            elapsed_s=elapsed_s,
        )

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts

    @property
    def per_position_rates(self) -> list[float]:
        return [accepted / self.num_drafts for accepted in self.accepted_per_pos]

    @property
    def acceptance_rate(self) -> float:
        if self.num_draft_tokens == 0:
            return float("nan")
        return self.num_accepted_tokens / self.num_draft_tokens

    def line(self) -> str:
        """vLLM's log line; only for an interval with drafts (``num_drafts > 0``)."""
        elapsed = max(self.elapsed_s, 1e-9)
        rates = ", ".join(f"{rate:.3f}" for rate in self.per_position_rates)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, "
            f"Accepted throughput: {self.num_accepted_tokens / elapsed:.2f} tokens/s, "
            f"Drafted throughput: {self.num_draft_tokens / elapsed:.2f} tokens/s, "
            f"Accepted: {self.num_accepted_tokens} tokens, "
            f"Drafted: {self.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {self.acceptance_rate * 100:.1f}%"
        )


class StatsLogger:
    """Feeds on engine-core reports (a ``stats_listeners`` callback) and logs each engine
    core's speculative decoding line once per interval."""

    def __init__(
        self,
        *,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.logger = logger
        self._starts: dict[str, tuple[float, SchedulerStats]] = {}  # engine → interval start
        self._last_step: dict[str, int] = {}

    def observe(self, stats: SchedulerStats, engine_id: str) -> None:
        """One report of ``engine_id``. Reports of an older step than the last arrived out of
        order and are ignored, unless the step fell by more than half (a restart)."""
        last_step = self._last_step.get(engine_id)
        if last_step is not None and stats.step_id < last_step <= stats.step_id * 2:
            return
        self._last_step[engine_id] = stats.step_id
        now = self.clock()
        start = self._starts.get(engine_id)
        if start is None:  # the first report: the first interval starts here
            self._starts[engine_id] = (now, stats)
            return
        started, before = start
        if now - started < self.interval_s:
            return
        self._starts[engine_id] = (now, stats)
        interval = SpecDecodingInterval.between(before, stats, now - started)
        if interval.num_drafts > 0:
            self.logger.info("%s: %s", engine_id, interval.line())
