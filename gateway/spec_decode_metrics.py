"""Speculative decoding on ``/metrics``: vLLM's ``vllm:spec_decode_*`` counters per engine core,
turned into increments from the cumulative figures of ``SchedulerStats``.

They exist only when the deployment speculates (as vLLM defines them only with a speculative
config), and then every series is there from an engine core's first report on, at 0:
``vllm:spec_decode_num_accepted_tokens_per_pos`` for positions 0 .. K-1 (K the configured
``num_speculative_tokens``, the most a dynamic schedule may ask for), and any further position
an engine core reports.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from shoal.bus.messages.engine import SchedulerStats

ENGINE_LABELS = ["model_name", "engine"]
# (name, help, SchedulerStats field), as vLLM's SpecDecodingProm.
SPEC_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts", "spec_decode_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens", "spec_decode_num_draft_tokens"),
    (
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens",
        "spec_decode_num_accepted_tokens",
    ),
)
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def increment(value: float, previous: float) -> float:
    """What a cumulative figure added since ``previous``; a drop means its engine core
    restarted, and the new value counts as fresh increments."""
    return value - previous if value >= previous else value


class SpecDecodeMetrics:
    """The four speculative decoding counters of one gateway's registry."""

    def __init__(self, registry: CollectorRegistry, num_speculative_tokens: int) -> None:
        self.num_positions = num_speculative_tokens
        self.counters = [
            (Counter(name, doc, ENGINE_LABELS, registry=registry), field)
            for name, doc, field in SPEC_COUNTERS
        ]
        self.per_pos = Counter(
            PER_POS,
            "Accepted tokens per draft position",
            [*ENGINE_LABELS, "position"],
            registry=registry,
        )

    def update(
        self, stats: SchedulerStats, last: SchedulerStats | None, labels: tuple[str, str]
    ) -> None:
        """Count what ``stats`` adds to ``last`` (None: the first report, or a restart)."""
        for counter, field in self.counters:
            previous = getattr(last, field) if last is not None else 0
            counter.labels(*labels).inc(increment(getattr(stats, field), previous))
        current = stats.spec_decode_num_accepted_tokens_per_pos
        before = last.spec_decode_num_accepted_tokens_per_pos if last is not None else []
        for pos in range(max(self.num_positions, len(current))):
            value = current[pos] if pos < len(current) else 0
            previous = before[pos] if pos < len(before) else 0
            self.per_pos.labels(*labels, str(pos)).inc(increment(value, previous))
