"""Backpressure on a slow secondary tier (pure): the CPU tier keeps, per secondary, a moving
average of how long its stores (cascades) take, and drops stores while the tier is under
pressure; loads (promotions) are never dropped.

Pressure begins when the average passes ``high_water_s`` or after ``failure_streak`` failed
stores (timeouts, errors) in a row, and ends when the average falls below ``low_water_s``
(hysteresis) and the last store succeeded. Under pressure a store is dropped with a probability
that grows with the average from the low to the high water mark, capped at
``max_drop_probability`` (below 1) so that some stores still measure the tier; and a store is
always let through when none was measured for ``probe_interval_s``, so sparse traffic does not
keep a tier that became fast under pressure.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from shoal.config.kv_transfer import BackpressureConfig


class StoreBackpressure:
    def __init__(
        self, config: BackpressureConfig, draw: Callable[[], float] = random.random
    ) -> None:
        self.config = config
        self._draw = draw  # uniform in [0, 1)
        self.average_s: float | None = None  # exponential moving average of store latency
        self.failures_in_a_row = 0
        self.under_pressure = False
        self.last_measured_at = float("-inf")  # when the last store was let through
        self.num_dropped = 0  # stores dropped for pressure
        self.num_pressure_episodes = 0

    def record_store(self, latency_s: float, succeeded: bool) -> None:
        """A store's outcome: how long it took, and whether it succeeded (False only for a
        timeout or an error, not for a tier that had no room)."""
        alpha, previous = self.config.ema_alpha, self.average_s
        self.average_s = (
            latency_s if previous is None else alpha * latency_s + (1 - alpha) * previous
        )
        self.failures_in_a_row = 0 if succeeded else self.failures_in_a_row + 1
        if not self.under_pressure and (
            self.average_s > self.config.high_water_s
            or self.failures_in_a_row >= self.config.failure_streak
        ):
            self.under_pressure = True
            self.num_pressure_episodes += 1
        elif self.under_pressure and succeeded and self.average_s < self.config.low_water_s:
            self.under_pressure = False

    @property
    def drop_probability(self) -> float:
        if not self.under_pressure or self.average_s is None:
            return 0.0
        low, high = self.config.low_water_s, self.config.high_water_s
        ramp = 1.0 if self.failures_in_a_row else (self.average_s - low) / (high - low)
        return min(self.config.max_drop_probability, max(0.0, ramp))

    def should_drop_store(self, now: float) -> bool:
        """Whether to drop the next store to this tier at ``now`` (monotonic seconds; counted
        when dropped)."""
        probe = now - self.last_measured_at >= self.config.probe_interval_s
        drop = self.under_pressure and not probe and self._draw() < self.drop_probability
        if drop:
            self.num_dropped += 1
        else:
            self.last_measured_at = now
        return drop
