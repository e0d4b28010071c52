"""The periodic SpecDecoding log line: vLLM's arithmetic over an interval, from two snapshots of
an engine core's cumulative counters, and the logger that prints it once per interval."""

from __future__ import annotations

import logging
import math

import pytest

from shoal.gateway.stats_logging import SpecDecodingInterval, StatsLogger
from tests.unit.test_gateway_metrics_spec import _stats

BEFORE = _stats(10, 100, 300, 150, [70, 50, 30])
AFTER = _stats(50, 140, 420, 210, [100, 70, 40])  # +40 drafts, +120 drafted, +60 accepted
LINE = (
    "SpecDecoding metrics: Mean acceptance length: 2.50, "
    "Accepted throughput: 6.00 tokens/s, Drafted throughput: 12.00 tokens/s, "
    "Accepted: 60 tokens, Drafted: 120 tokens, "
    "Per-position acceptance rate: 0.750, 0.500, 0.250, Avg Draft acceptance rate: 50.0%"
)


def test_the_interval_is_the_difference_of_two_snapshots() -> None:
    interval = SpecDecodingInterval.between(BEFORE, AFTER, 10.0)
    assert (interval.num_drafts, interval.num_draft_tokens, interval.num_accepted_tokens) == (
        40, 120, 60,
    )  # fmt: skip
    assert interval.accepted_per_pos == (30, 20, 10)
    assert interval.mean_acceptance_length == 1 + 60 / 40
    assert interval.per_position_rates == [30 / 40, 20 / 40, 10 / 40]
    assert interval.acceptance_rate == 60 / 120
    assert interval.line() == LINE


def test_a_restarted_core_and_a_longer_per_position_list_count_from_zero() -> None:
    restarted = _stats(2, 8, 24, 6, [4, 2, 0, 0])  # counters fell; K grew to 4
    interval = SpecDecodingInterval.between(AFTER, restarted, 2.0)
    assert (interval.num_drafts, interval.num_draft_tokens, interval.num_accepted_tokens) == (
        8, 24, 6,
    )  # fmt: skip
    assert interval.accepted_per_pos == (4, 2, 0, 0)
    assert "Per-position acceptance rate: 0.500, 0.250, 0.000, 0.000" in interval.line()
    assert math.isnan(SpecDecodingInterval(1, 0, 0, (), 1.0).acceptance_rate)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_logger_prints_each_engines_line_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    logger = StatsLogger(interval_s=10.0, clock=clock)
    caplog.set_level(logging.INFO, logger="shoal.gateway.stats_logging")
    logger.observe(BEFORE, "engine-0")  # the first interval starts here
    clock.now = 4.0
    logger.observe(_stats(30, 120, 360, 180, [85, 60, 35]), "engine-0")  # mid-interval
    assert caplog.messages == []
    clock.now = 10.0
    logger.observe(AFTER, "engine-0")
    assert caplog.messages == [f"engine-0: {LINE}"]
    clock.now = 25.0
    logger.observe(_stats(49, 139, 417, 209, [99, 70, 40]), "engine-0")  # late: ignored
    assert len(caplog.messages) == 1
    logger.observe(_stats(60, 140, 420, 210, [100, 70, 40]), "engine-0")  # no new drafts
    assert len(caplog.messages) == 1  # an interval without drafts logs nothing
    clock.now = 40.0
    logger.observe(_stats(70, 150, 450, 220, [105, 73, 42]), "engine-0")
    assert caplog.messages[-1].startswith("engine-0: SpecDecoding metrics: Mean acceptance ")
    assert (
        "Accepted throughput: 0.67 tokens/s, Drafted throughput: 2.00 tokens/s"
        in (caplog.messages[-1])
    )  # 10 accepted and 30 drafted over the 15 s of the interval


def test_engines_have_their_own_intervals(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    logger = StatsLogger(interval_s=5.0, clock=clock)
    caplog.set_level(logging.INFO, logger="shoal.gateway.stats_logging")
    logger.observe(BEFORE, "engine-0")
    clock.now = 3.0
    logger.observe(BEFORE, "engine-1")
    clock.now = 6.0
    logger.observe(AFTER, "engine-0")
    logger.observe(AFTER, "engine-1")  # only 3 s into its interval
    assert [m.split(":")[0] for m in caplog.messages] == ["engine-0"]
    clock.now = 8.0
    logger.observe(AFTER, "engine-1")
    assert caplog.messages[-1].startswith("engine-1: ")
    assert "Accepted throughput: 12.00 tokens/s" in caplog.messages[-1]  # 60 over 5 s
