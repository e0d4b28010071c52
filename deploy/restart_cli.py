"""``shoal restart``: restart the actors of a NATS deployment one at a time, nothing lost.

It joins the bus as ``shoal status`` does, listens to every actor's heartbeats and status
events (``deploy.status_board``), picks the actors named (kinds or ids; with ``--rolling`` and
no name, every one) in ``deploy.restart_plan``'s order and, for each in turn: waits until
another engine core is ready where the actor's engine core would stop, sends ``RestartActor``
on the actor's restart subject, and waits until a new incarnation of it heartbeats READY (and,
for a worker, its engine core READY again) before the next. It refuses, before restarting
anything, a restart that would take the last ready engine core down.

Every restart prints a line (``--json``: the last line is one JSON object with every actor's
outcome and ``restart_s`` per kind). Exit status: 0 done, 1 a restart failed or timed out, 2 no
bus or no such actor, 3 refused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from shoal.bus.base import Bus
from shoal.bus.codec import Codec
from shoal.bus.errors import BusError, RemoteError
from shoal.bus.messages.control import ActorState, RestartAccepted, RestartActor
from shoal.bus.runtime.actor import call
from shoal.bus.subjects import Subjects
from shoal.deploy.arguments import add_deployment_bus_arguments, positive_float
from shoal.deploy.restart_plan import UnknownTarget, keeps_an_engine, refusal, select_targets
from shoal.deploy.status_board import ActorRow, StatusBoard
from shoal.deploy.status_cli import connect_operator_bus, listen

EXIT_OK, EXIT_FAILED, EXIT_NO_TARGET, EXIT_REFUSED = 0, 1, 2, 3
_ACCEPTED: Codec[RestartAccepted] = Codec(RestartAccepted)
ANSWER_TIMEOUT_S = 10.0


def add_restart_arguments(parser: argparse.ArgumentParser, namespace: str) -> None:
    add_deployment_bus_arguments(parser, namespace)
    parser.add_argument(
        "targets", nargs="*", metavar="KIND_OR_ID",
        help="kinds (recovery, tier, worker, engine, gateway) or actor ids; none: every actor",
    )  # fmt: skip
    parser.add_argument(
        "--rolling", action="store_true",
        help="every actor when none is named (restarts always go one at a time, each ready "
        "before the next)",
    )  # fmt: skip
    parser.add_argument(
        "--ready-timeout-s", type=positive_float, default=300.0,
        help="how long each actor may take to be ready again",
    )  # fmt: skip
    parser.add_argument(
        "--listen-s", type=positive_float, default=2.5, help="how long to listen for the actors"
    )
    parser.add_argument("--reason", default="shoal restart", help="told to each actor")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")


@dataclass
class Outcome:
    """What became of one actor."""

    id: str
    kind: str
    result: str  # restarted, skipped (it refused: nothing would start it again), failed
    detail: str = ""
    old_incarnation: str = ""
    new_incarnation: str = ""
    restart_s: float | None = None


class Watch:
    """The board, fed from the bus, and a way to wait until it shows something."""

    def __init__(self) -> None:
        self.board = StatusBoard()
        self._changed = asyncio.Condition()

    async def start(self, bus: Bus, namespace: str) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        await listen(bus, namespace, self.board, on_change=notify)

    def row(self, actor_id: str) -> ActorRow | None:
        return self.board.rows.get(actor_id)

    async def until(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Whether ``condition`` held within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(condition)
        except TimeoutError:
            return False
        return True


class RollingRestart:
    """Restarts actors one at a time on ``bus``, judged by ``watch``."""

    def __init__(
        self, bus: Bus, watch: Watch, namespace: str, *, ready_timeout_s: float, reason: str
    ) -> None:
        self.bus, self.watch, self.subjects = bus, watch, Subjects(namespace)
        self.ready_timeout_s, self.reason = ready_timeout_s, reason

    async def restart(self, target: ActorRow) -> Outcome:
        outcome = Outcome(target.actor_id, target.kind, "failed")
        rows = self.watch.board.rows.values
        keeps = await self.watch.until(
            lambda: keeps_an_engine(target, rows()), self.ready_timeout_s
        )
        if not keeps:
            outcome.detail = "no other engine core became ready to take its requests"
            return outcome
        started = time.monotonic()
        try:
            accepted = await self._ask(target)
        except RemoteError as exc:
            skipped = exc.code == "refused"
            outcome.result, outcome.detail = ("skipped" if skipped else "failed"), exc.message
            return outcome
        except BusError as exc:
            outcome.detail = f"no answer: {exc}"
            return outcome
        outcome.old_incarnation = accepted.incarnation
        back = await self.watch.until(
            lambda: self._new_life_ready(target, accepted), self.ready_timeout_s
        )
        if not back:
            outcome.detail = f"not ready again within {self.ready_timeout_s:g} s"
            return outcome
        if not await self._engine_ready_again(target):
            outcome.detail = f"its engine core {target.engine_id} did not recover"
            return outcome
        row = self.watch.row(target.actor_id)
        outcome.new_incarnation = row.incarnation if row else ""
        outcome.result, outcome.restart_s = "restarted", round(time.monotonic() - started, 3)
        return outcome

    async def _ask(self, target: ActorRow) -> RestartAccepted:
        """The actor's answer (``RemoteError`` with code ``refused``: it will not restart)."""
        subject = self.subjects.restart(target.kind, target.actor_id)
        accepted: RestartAccepted = await call(
            self.bus, subject, RestartActor(self.reason), _ACCEPTED, timeout=ANSWER_TIMEOUT_S
        )
        return accepted

    def _new_life_ready(self, target: ActorRow, accepted: RestartAccepted) -> bool:
        row = self.watch.row(target.actor_id)
        return (
            row is not None
            and row.incarnation != accepted.incarnation
            and row.state is ActorState.READY
        )

    async def _engine_ready_again(self, target: ActorRow) -> bool:
        """A worker's engine core lost it: wait for the core's READY heard after this point."""
        engine_id = target.engine_id
        engine = self.watch.row(engine_id) if engine_id != target.actor_id else None
        if engine is None:
            return True
        mark = engine.num_heard
        return await self.watch.until(
            lambda: engine.num_heard > mark and engine.state is ActorState.READY,
            self.ready_timeout_s,
        )


def summary(outcomes: list[Outcome]) -> dict[str, object]:
    """The last line of ``--json``: every outcome, and the median restart time per kind."""
    by_kind: dict[str, list[float]] = {}
    for o in outcomes:
        if o.restart_s is not None:
            by_kind.setdefault(o.kind, []).append(o.restart_s)
    return {
        "actors": [asdict(o) for o in outcomes],
        "restarted": sum(o.result == "restarted" for o in outcomes),
        "failed": sum(o.result == "failed" for o in outcomes),
        "restart_s": {kind: round(statistics.median(ts), 3) for kind, ts in by_kind.items()},
    }


def _line(outcome: Outcome) -> str:
    name = f"{outcome.kind} {outcome.id}"
    if outcome.result == "restarted":
        return (
            f"restarted {name} in {outcome.restart_s:.1f} s "
            f"({outcome.old_incarnation[:12]} -> {outcome.new_incarnation[:12]})"
        )
    return f"{outcome.result} {name}: {outcome.detail}"


async def run_restart(ns: argparse.Namespace) -> int:
    if not ns.targets and not ns.rolling:
        print("shoal restart: name kinds or actor ids, or give --rolling for every actor",
              file=sys.stderr)  # fmt: skip
        return EXIT_NO_TARGET
    bus = await connect_operator_bus(ns)
    if bus is None:
        return EXIT_NO_TARGET
    try:
        watch = Watch()
        await watch.start(bus, ns.namespace)
        await asyncio.sleep(ns.listen_s)
        return await _restart_all(bus, watch, ns)
    finally:
        await bus.close()


async def _restart_all(bus: Bus, watch: Watch, ns: argparse.Namespace) -> int:
    rows = watch.board.sorted_rows()
    try:
        targets = select_targets(rows, ns.targets)
    except UnknownTarget as exc:
        print(f"shoal restart: {exc}", file=sys.stderr)
        return EXIT_NO_TARGET
    refused = refusal(targets, rows)
    if refused is not None:
        print(f"shoal restart: refused: {refused}", file=sys.stderr)
        return EXIT_REFUSED
    rolling = RollingRestart(
        bus, watch, ns.namespace, ready_timeout_s=ns.ready_timeout_s, reason=ns.reason
    )
    outcomes = []
    for target in targets:
        outcome = await rolling.restart(target)
        outcomes.append(outcome)
        print(_line(outcome), flush=True)
        if outcome.result == "failed":
            break  # the next one could take the last engine core down
    if ns.json:
        print(json.dumps(summary(outcomes)))
    return EXIT_FAILED if any(o.result == "failed" for o in outcomes) else EXIT_OK
