"""The fault-tolerance status (vLLM's ``GET /fault_tolerance/status`` body) read from a liveness
table, and the gateway's engine-status metrics counted from status changes."""

from __future__ import annotations

import msgspec

from shoal.bus.messages.control import ActorState, Heartbeat, StatusEvent
from shoal.bus.runtime.liveness import LivenessTable
from shoal.engine.client.fault_tolerance import FailedCommand, ft_status
from shoal.gateway.metrics import Metrics

LOST_AFTER_S = 20.0


def _beat(actor_id: str, state: ActorState, seq: int = 0) -> Heartbeat:
    return Heartbeat(actor_id, "engine", seq, state, 0.0, incarnation=f"{actor_id}-1")


def _status(actor_id: str, state: ActorState, reason: str) -> StatusEvent:
    return StatusEvent(actor_id, "engine", state, 0.0, reason, incarnation=f"{actor_id}-1")


def _as_json(table: LivenessTable, now: float, **options: object) -> object:
    body = ft_status(table, lost_after_s=LOST_AFTER_S, now=now, **options)  # type: ignore[arg-type]
    return msgspec.json.decode(msgspec.json.encode(body))


def test_status_lists_every_engine_core_with_vllm_names_and_faults_only_while_faulted() -> None:
    table = LivenessTable()
    table.on_event(_beat("e0", ActorState.READY), now=0.0)
    table.on_event(_status("e1", ActorState.UNHEALTHY, "InjectedFault: boom"), now=0.0)
    table.on_event(_beat("e1", ActorState.UNHEALTHY, 1), now=1.0)  # the reason outlives beats
    table.on_event(_status("e2", ActorState.DEAD, "worker w2 gone"), now=0.0)
    table.on_event(_status("e3", ActorState.READY, "recovered"), now=0.0)  # no fault: no info
    assert _as_json(table, now=2.0) == {
        "schema_version": 1,
        "total_engines": 4,
        "engines": [
            {"id": "e0", "status": "healthy"},
            {"id": "e1", "status": "unhealthy", "fault_info": "InjectedFault: boom"},
            {"id": "e2", "status": "dead", "fault_info": "worker w2 gone"},
            {"id": "e3", "status": "healthy"},
        ],
    }


def test_status_shows_a_failed_command_and_an_engine_core_silent_past_the_bound_as_dead() -> None:
    table = LivenessTable()
    table.on_event(_beat("e0", ActorState.READY), now=0.0)
    table.touch("e1", now=30.0)  # known from its stats only
    failed = {"e1": FailedCommand("ft-1", "[FT] rejected: status is healthy")}
    body = _as_json(table, now=30.0, failed=failed)
    assert body == {
        "schema_version": 1,
        "total_engines": 2,
        "engines": [
            {"id": "e0", "status": "dead", "fault_info": "silent for 30 s (last state healthy)"},
            {
                "id": "e1",
                "status": "healthy",
                "last_ft_request_id": "ft-1",
                "ft_error": "[FT] rejected: status is healthy",
            },
        ],
    }


def test_empty_table_has_no_engines() -> None:
    assert _as_json(LivenessTable(), now=0.0) == {
        "schema_version": 1,
        "total_engines": 0,
        "engines": [],
    }


def _sample(metrics: Metrics, name: str, engine: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": engine})


def test_metrics_count_a_fault_on_entering_unhealthy_or_dead_and_a_recovery_on_healthy() -> None:
    metrics = Metrics("m")
    for status in ("starting", "healthy", "unhealthy", "dead", "unhealthy", "healthy", "dead"):
        metrics.observe_engine_status("e0", status)
    metrics.observe_engine_status("e1", "healthy")
    assert _sample(metrics, "shoal:engine_faults_total", "e0") == 2
    assert _sample(metrics, "shoal:engine_recoveries_total", "e0") == 1
    assert _sample(metrics, "shoal:engine_status", "e0") == 1  # dead, vLLM's value
    assert _sample(metrics, "shoal:engine_faults_total", "e1") == 0  # exported at 0
    assert _sample(metrics, "shoal:engine_recoveries_total", "e1") == 0
    assert _sample(metrics, "shoal:engine_status", "e1") == 0


def test_metrics_count_a_restart_through_starting_as_a_recovery() -> None:
    metrics = Metrics("m")
    for status in ("healthy", "dead", "starting", "healthy"):
        metrics.observe_engine_status("e0", status)
    assert _sample(metrics, "shoal:engine_faults_total", "e0") == 1
    assert _sample(metrics, "shoal:engine_recoveries_total", "e0") == 1
    assert _sample(metrics, "shoal:engine_status", "e0") == 0
