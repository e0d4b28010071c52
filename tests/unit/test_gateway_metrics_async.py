"""Async scheduling on ``/metrics``: steps in flight (a gauge) and the worker's idle and busy
time (cumulative counters, restarts counted as fresh increments)."""

from __future__ import annotations

from shoal.bus.messages.engine import SchedulerStats
from shoal.gateway.metrics import Metrics


def _get(metrics: Metrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "e0"})


def _stats(step_id: int, idle_s: float, execute_s: float, in_flight: int) -> SchedulerStats:
    return SchedulerStats(
        step_id=step_id,
        worker_execute_s=execute_s,
        worker_idle_s=idle_s,
        num_steps_in_flight=in_flight,
    )


def test_steps_in_flight_and_worker_idle_time() -> None:
    metrics = Metrics("m")
    metrics.update_engine_stats(_stats(5, 0.25, 2.0, 2), "e0")
    metrics.update_engine_stats(_stats(9, 0.5, 3.0, 1), "e0")
    assert _get(metrics, "shoal:engine_steps_in_flight") == 1
    assert _get(metrics, "shoal:worker_idle_seconds_total") == 0.5
    assert _get(metrics, "shoal:worker_execute_seconds_total") == 3.0
    metrics.update_engine_stats(_stats(1, 0.125, 1.0, 0), "e0")  # the engine core restarted
    assert _get(metrics, "shoal:engine_steps_in_flight") == 0
    assert _get(metrics, "shoal:worker_idle_seconds_total") == 0.625
    assert _get(metrics, "shoal:worker_execute_seconds_total") == 4.0
