"""Backpressure on a slow secondary tier (``tiers/books/backpressure.py``): pressure begins past the
high water mark or after a streak of failures, ends below the low water mark (hysteresis), and
drops stores with a probability that grows with the average, never all of them."""

from __future__ import annotations

import pytest

from shoal.config.kv_transfer import BackpressureConfig, kv_transfer_options
from shoal.tiers.books.backpressure import StoreBackpressure

CONFIG = BackpressureConfig(ema_alpha=0.5, high_water_s=1.0, low_water_s=0.2,
                            max_drop_probability=0.9, failure_streak=3,
                            probe_interval_s=100.0)  # fmt: skip
NOW = 0.0  # well inside the probe interval of the last measured store, once there is one


def test_fast_stores_are_never_dropped() -> None:
    bp = StoreBackpressure(CONFIG, draw=lambda: 0.0)
    for _ in range(20):
        bp.record_store(0.05, True)
        assert not bp.should_drop_store(NOW)
    assert bp.num_dropped == 0 and bp.num_pressure_episodes == 0


def test_pressure_begins_past_the_high_mark_and_ends_below_the_low_one() -> None:
    bp = StoreBackpressure(CONFIG, draw=lambda: 0.5)
    assert not bp.should_drop_store(NOW)  # the first store goes (and is measured) ...
    bp.record_store(0.8, True)  # ... in 0.8 s
    assert not bp.under_pressure  # 0.8 < 1.0
    bp.record_store(2.0, True)  # average 1.4
    assert bp.under_pressure and bp.num_pressure_episodes == 1
    assert bp.drop_probability == pytest.approx(0.9)  # capped: some stores still measure
    assert bp.should_drop_store(NOW)
    bp.record_store(0.4, True)  # average 0.9: below high but above low: still under pressure
    assert bp.under_pressure and bp.drop_probability == pytest.approx(0.875)
    bp.record_store(0.1, True)  # 0.5
    bp.record_store(0.1, True)  # 0.3
    assert bp.under_pressure and bp.drop_probability == pytest.approx(0.125)
    assert not bp.should_drop_store(NOW)  # the draw 0.5 passes a 12.5% drop
    bp.record_store(0.05, True)  # 0.175 < 0.2: pressure ends
    assert not bp.under_pressure and bp.drop_probability == 0.0
    assert bp.num_dropped == 1


def test_a_streak_of_failures_is_pressure_until_a_store_succeeds_fast() -> None:
    bp = StoreBackpressure(CONFIG, draw=lambda: 0.5)
    for _ in range(2):
        bp.record_store(0.01, False)
    assert not bp.under_pressure
    bp.record_store(0.01, False)
    assert bp.under_pressure and bp.drop_probability == pytest.approx(0.9)
    bp.record_store(0.01, True)
    assert not bp.under_pressure


def test_the_vllm_json_sets_it_and_bad_values_are_named() -> None:
    extra = {"cpu_bytes_to_use": 1 << 20, "backpressure": {"high_water_s": 0.5, "low_water_s": 0.1}}
    kv = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}
    options = kv_transfer_options(kv, 16)
    assert options["backpressure"].high_water_s == 0.5
    bad = {**extra, "backpressure": {"high_water_s": 0.1, "low_water_s": 0.5}}
    with pytest.raises(ValueError, match="low_water_s"):
        kv_transfer_options({**kv, "kv_connector_extra_config": bad}, 16)


def test_a_store_goes_through_to_probe_a_tier_unmeasured_for_a_while() -> None:
    """Sparse traffic: a tier that became fast again is measured once the probe interval
    passed, whatever the draw, and its pressure can end."""
    bp = StoreBackpressure(CONFIG, draw=lambda: 0.0)  # every draw would drop
    assert not bp.should_drop_store(0.0)  # not under pressure: measured
    bp.record_store(5.0, True)
    assert bp.under_pressure
    assert bp.should_drop_store(50.0) and bp.should_drop_store(99.0)
    assert not bp.should_drop_store(100.0)  # 100 s since the last measured store: a probe
    assert bp.should_drop_store(101.0)
    for _ in range(6):
        bp.record_store(0.01, True)
    assert not bp.under_pressure


def test_a_drop_probability_of_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_drop_probability"):
        BackpressureConfig(max_drop_probability=1.0)
