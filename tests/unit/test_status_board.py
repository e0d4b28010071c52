"""``shoal status``'s board: rows from heartbeats and status events, in kind order; steps per
second from two heartbeats; KV usage by kind; a new incarnation counted as a restart (late
messages of the old one ignored); the last fault kept; the text table's columns."""

from __future__ import annotations

from shoal.bus.messages.control import ActorState, Heartbeat, StatusEvent
from shoal.deploy.status_board import StatusBoard
from shoal.deploy.status_cli import COLUMNS, text_table

READY, UNHEALTHY = ActorState.READY, ActorState.UNHEALTHY


def beat(actor_id: str, kind: str, t: float, load: dict[str, float], life: str = "a") -> Heartbeat:
    return Heartbeat(actor_id, kind, 1, READY, t, load, life, "host-1", 100.0)


def test_rows_in_kind_order_with_steps_kv_and_uptime() -> None:
    board = StatusBoard()
    blocks = {"num_blocks": 100.0, "num_blocks_in_use": 25.0}
    engine_load = {"num_steps": 10.0, "kv_usage": 0.5, "num_running": 3.0, "num_waiting": 1.0}
    board.on_heartbeat(beat("worker-0-0", "worker", 110.0, {"num_steps": 40.0, **blocks}))
    board.on_heartbeat(beat("engine-0", "engine", 110.0, engine_load))
    board.on_heartbeat(beat("kv-cpu", "tier", 110.0, {"usage": 0.125}))
    blocks["num_blocks_in_use"] = 50.0
    board.on_heartbeat(beat("worker-0-0", "worker", 112.0, {"num_steps": 100.0, **blocks}))
    rows = board.sorted_rows()
    assert [r.actor_id for r in rows] == ["engine-0", "worker-0-0", "kv-cpu"]
    engine, worker, tier = rows
    assert worker.steps_per_s == 30.0 and engine.steps_per_s is None  # one engine beat so far
    assert (engine.kv_usage, worker.kv_usage, tier.kv_usage) == (0.5, 0.5, 0.125)
    assert engine.shown_load() == "running=3 waiting=1"
    assert worker.uptime_s(130.0) == 30.0 and worker.host == "host-1"
    table = text_table(rows, 130.0).splitlines()
    assert table[0].split()[:3] == ["KIND", "ID", "HOST"] and len(table) == 4
    assert table[1].split()[:5] == ["engine", "engine-0", "host-1", "a", "ready"]
    assert len(COLUMNS) == len(set(COLUMNS))


def test_a_new_incarnation_is_a_restart_and_the_last_fault_stays() -> None:
    board = StatusBoard()
    board.on_heartbeat(beat("engine-0", "engine", 10.0, {"num_steps": 5}, life="one"))
    board.on_status(StatusEvent("engine-0", "engine", UNHEALTHY, 11.0, "worker lost", "one"))
    row = board.rows["engine-0"]
    assert (row.state, row.last_fault) == (UNHEALTHY, "worker lost")
    board.on_status(StatusEvent("engine-0", "engine", ActorState.DEAD, 12.0, "exited 1"))
    board.on_heartbeat(beat("engine-0", "engine", 15.0, {"num_steps": 0}, life="two"))
    assert (row.incarnation, row.num_restarts, row.state) == ("two", 1, READY)
    assert row.last_fault == "exited 1" and row.steps_per_s is None
    board.on_heartbeat(beat("engine-0", "engine", 14.0, {"num_steps": 99}, life="one"))  # late
    assert (row.incarnation, row.num_restarts) == ("two", 1)
    assert row.as_json(20.0)["state"] == "READY"


def test_a_row_names_the_engine_core_the_actor_serves() -> None:
    board = StatusBoard()
    board.on_heartbeat(
        Heartbeat("worker-1-0", "worker", 1, READY, 5.0, {}, "a", "h", 1.0, "engine-1")
    )
    board.on_heartbeat(beat("kv-cpu", "tier", 5.0, {}))
    worker, tier = board.rows["worker-1-0"], board.rows["kv-cpu"]
    assert (worker.engine_id, tier.engine_id) == ("engine-1", "")
    assert worker.as_json(6.0)["engine_id"] == "engine-1" and worker.num_heard == 1
