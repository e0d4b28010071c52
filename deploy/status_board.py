"""The deployment as its actors tell it (what ``shoal status`` and ``shoal top`` show): every
actor heard on the namespace's heartbeat and status subjects, with its kind, host, incarnation,
state, uptime, load, KV usage, steps per second and last fault.

``StatusBoard`` folds ``Heartbeat`` and ``StatusEvent`` messages into one ``ActorRow`` per actor;
it is pure (no bus, no clock but the messages' own timestamps). A new incarnation of an actor is
a restart (counted); steps per second come from the ``num_steps`` of its two latest heartbeats
(workers and engine cores report one); KV usage is an engine core's ``kv_usage``, a worker's
blocks in use over its blocks, or a KV tier's ``usage``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.bus.messages.control import ActorState, Heartbeat, StatusEvent

KIND_ORDER = ("gateway", "engine", "worker", "tier", "recovery")
FAULT_STATES = (ActorState.UNHEALTHY, ActorState.DEAD)
# The load figures a row shows, by kind (the rest stay in --json's "load").
LOAD_FIGURES = {
    "engine": ("num_running", "num_waiting"),
    "worker": ("num_requests",),
    "tier": ("num_chunks",),
    "recovery": ("num_retries_sent",),
}


@dataclass(slots=True)
class ActorRow:
    actor_id: str
    kind: str
    state: ActorState
    host: str = ""
    incarnation: str = ""
    started_at: float = 0.0  # wall time the incarnation started (0: not told)
    last_seen: float = 0.0  # wall time of its latest message
    load: dict[str, float] = field(default_factory=dict)
    num_restarts: int = 0
    num_heard: int = 0  # messages folded in (a newer message than one seen at some moment)
    engine_id: str = ""  # the engine core it serves (an engine core's own id)
    last_fault: str = ""
    steps_per_s: float | None = None
    _steps_mark: tuple[float, float] | None = None  # (timestamp, num_steps) of the last beat

    def uptime_s(self, now: float) -> float | None:
        return max(0.0, now - self.started_at) if self.started_at else None

    @property
    def kv_usage(self) -> float | None:
        load = self.load
        if "kv_usage" in load:
            return load["kv_usage"]
        if load.get("num_blocks"):
            return load.get("num_blocks_in_use", 0.0) / load["num_blocks"]
        if self.kind == "tier" and "usage" in load:
            return load["usage"]
        return None

    def shown_load(self) -> str:
        figures = LOAD_FIGURES.get(self.kind, ())
        return " ".join(
            f"{name.removeprefix('num_')}={self.load[name]:g}"
            for name in figures
            if name in self.load
        )

    def as_json(self, now: float) -> dict[str, Any]:
        return {
            "id": self.actor_id,
            "kind": self.kind,
            "host": self.host,
            "incarnation": self.incarnation,
            "state": self.state.name,
            "uptime_s": _rounded(self.uptime_s(now)),
            "last_seen_s": round(max(0.0, now - self.last_seen), 3),
            "kv_usage": _rounded(self.kv_usage),
            "steps_per_s": _rounded(self.steps_per_s),
            "num_restarts": self.num_restarts,
            "engine_id": self.engine_id,
            "last_fault": self.last_fault,
            "load": dict(self.load),
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class StatusBoard:
    """One row per actor heard from."""

    def __init__(self) -> None:
        self.rows: dict[str, ActorRow] = {}

    def _row(self, actor_id: str, kind: str, state: ActorState) -> ActorRow:
        row = self.rows.get(actor_id)
        if row is None:
            row = self.rows[actor_id] = ActorRow(actor_id, kind, state)
        return row

    def _note_incarnation(self, row: ActorRow, incarnation: str) -> None:
        if not incarnation or incarnation == row.incarnation:
            return
        if row.incarnation:
            row.num_restarts += 1
            row._steps_mark = None
            row.steps_per_s = None
        row.incarnation = incarnation

    def on_heartbeat(self, beat: Heartbeat) -> None:
        row = self._row(beat.actor_id, beat.kind, beat.state)
        if beat.timestamp < row.last_seen:
            return  # a late one
        self._note_incarnation(row, beat.incarnation)
        row.state, row.last_seen, row.load = beat.state, beat.timestamp, dict(beat.load)
        row.num_heard += 1
        row.host = beat.host or row.host
        row.engine_id = beat.engine_id or row.engine_id
        row.started_at = beat.started_at or row.started_at
        steps = beat.load.get("num_steps")
        if steps is None:
            return
        if row._steps_mark is not None:
            then, before = row._steps_mark
            if beat.timestamp > then:
                row.steps_per_s = max(0.0, steps - before) / (beat.timestamp - then)
        row._steps_mark = (beat.timestamp, steps)

    def on_status(self, event: StatusEvent) -> None:
        row = self._row(event.actor_id, event.kind, event.state)
        if event.timestamp < row.last_seen:
            return
        self._note_incarnation(row, event.incarnation)
        row.state, row.last_seen = event.state, event.timestamp
        row.num_heard += 1
        if event.state in FAULT_STATES and event.reason:
            row.last_fault = event.reason

    def sorted_rows(self) -> list[ActorRow]:
        def order(row: ActorRow) -> tuple[int, str]:
            rank = KIND_ORDER.index(row.kind) if row.kind in KIND_ORDER else len(KIND_ORDER)
            return rank, row.actor_id

        return sorted(self.rows.values(), key=order)
