"""What ``shoal restart`` restarts, in which order, and when it may restart the next one.

Pure: it reads ``deploy.status_board`` rows (the actors as their heartbeats tell them).
``select_targets`` turns kinds and actor ids into the actors to restart, one at a time, in
``RESTART_ORDER``: the recovery controller first (the others' recoveries need it), then the KV
tiers, the workers, the engine cores, and the gateways last. ``keeps_an_engine`` says whether an
actor may go down now: an engine core, or a worker (its engine core stops stepping without it),
only while another engine core is ready, so requests always have one to run on.
``refusal`` says why a whole restart can never keep one (fewer than two engine cores).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shoal.bus.messages.control import ActorState
from shoal.deploy.status_board import ActorRow

RESTART_ORDER = ("recovery", "tier", "worker", "engine", "gateway")


class UnknownTarget(ValueError):
    """A name that is neither a kind nor the id of an actor heard from."""


def select_targets(rows: Iterable[ActorRow], names: Sequence[str]) -> list[ActorRow]:
    """The actors ``names`` (kinds or ids; none: every actor) name, in restart order."""
    rows = [row for row in rows if row.state is not ActorState.STOPPED]
    known = {row.kind for row in rows} | {row.actor_id for row in rows}
    unknown = [name for name in names if name not in known and name not in RESTART_ORDER]
    if unknown:
        raise UnknownTarget(f"no actor or kind named {', '.join(unknown)} was heard from")
    wanted = set(names)
    chosen = [r for r in rows if not wanted or r.kind in wanted or r.actor_id in wanted]
    return sorted(chosen, key=_restart_rank)


def _restart_rank(row: ActorRow) -> tuple[int, str]:
    kind = RESTART_ORDER.index(row.kind) if row.kind in RESTART_ORDER else len(RESTART_ORDER)
    return kind, row.actor_id


def ready_engines(rows: Iterable[ActorRow]) -> set[str]:
    return {r.actor_id for r in rows if r.kind == "engine" and r.state is ActorState.READY}


def keeps_an_engine(target: ActorRow, rows: Iterable[ActorRow]) -> bool:
    """Restarting ``target`` now leaves an engine core ready (it serves none, or another is)."""
    return not target.engine_id or bool(ready_engines(rows) - {target.engine_id})


def refusal(targets: Sequence[ActorRow], rows: Sequence[ActorRow]) -> str | None:
    """Why restarting ``targets`` would take the last ready engine core down, or None."""
    engines = {r.actor_id for r in rows if r.kind == "engine"}
    needing = [t for t in targets if t.engine_id]
    if not needing or len(engines) > 1:
        return None
    first = needing[0]
    what = "it" if first.kind == "engine" else f"its engine core {first.engine_id}"
    return (
        f"restarting {first.kind} {first.actor_id} would take the last ready engine core down "
        f"(restarting {what} leaves none to run requests on); run at least two engine cores "
        "(--data-parallel-size 2) to restart without a pause"
    )
