"""``shoal restart``'s plan: the actors named (kinds or ids) in restart order, the recovery
controller first and the gateways last; an actor whose engine core would stop waits for
another ready engine core; a restart of a deployment with one engine core is refused."""

from __future__ import annotations

import pytest

from shoal.bus.messages.control import ActorState
from shoal.deploy.restart_cli import Outcome, summary
from shoal.deploy.restart_plan import (
    UnknownTarget,
    keeps_an_engine,
    refusal,
    select_targets,
)
from shoal.deploy.status_board import ActorRow

READY, UNHEALTHY = ActorState.READY, ActorState.UNHEALTHY


def deployment(num_engines: int) -> list[ActorRow]:
    rows = [ActorRow("gateway-0", "gateway", READY), ActorRow("kv-cpu", "tier", READY)]
    for d in range(num_engines):
        rows.append(ActorRow(f"engine-{d}", "engine", READY, engine_id=f"engine-{d}"))
        rows.append(ActorRow(f"worker-{d}-0", "worker", READY, engine_id=f"engine-{d}"))
    return [*rows, ActorRow("recovery-0", "recovery", READY)]


def ids(rows: list[ActorRow]) -> list[str]:
    return [row.actor_id for row in rows]


def test_every_actor_in_restart_order_or_only_those_named() -> None:
    rows = deployment(2)
    assert ids(select_targets(rows, [])) == [
        "recovery-0", "kv-cpu", "worker-0-0", "worker-1-0", "engine-0", "engine-1", "gateway-0",
    ]  # fmt: skip
    assert ids(select_targets(rows, ["engine", "worker-1-0"])) == [
        "worker-1-0", "engine-0", "engine-1",
    ]  # fmt: skip
    assert ids(select_targets(rows, ["gateway"])) == ["gateway-0"]
    with pytest.raises(UnknownTarget, match="engine-7"):
        select_targets(rows, ["engine-7"])
    rows[0].state = ActorState.STOPPED  # a gateway that stopped for good is not restarted
    assert "gateway-0" not in ids(select_targets(rows, []))


def test_an_engine_core_or_its_worker_goes_down_only_while_another_core_is_ready() -> None:
    rows = deployment(2)
    by_id = {row.actor_id: row for row in rows}
    assert keeps_an_engine(by_id["engine-0"], rows) and keeps_an_engine(by_id["worker-0-0"], rows)
    by_id["engine-1"].state = UNHEALTHY  # recovering from its worker's restart
    assert not keeps_an_engine(by_id["engine-0"], rows)
    assert not keeps_an_engine(by_id["worker-0-0"], rows)
    assert keeps_an_engine(by_id["worker-1-0"], rows)  # its own core is the one down
    assert keeps_an_engine(by_id["kv-cpu"], rows) and keeps_an_engine(by_id["gateway-0"], rows)


def test_one_engine_core_refuses_what_would_stop_it_and_allows_the_rest() -> None:
    rows = deployment(1)
    for names in ([], ["worker"], ["engine-0"]):
        reason = refusal(select_targets(rows, names), rows)
        assert reason is not None and "last ready engine core" in reason
    assert refusal(select_targets(rows, ["recovery", "tier", "gateway"]), rows) is None
    assert refusal(select_targets(deployment(2), []), deployment(2)) is None


def test_the_summary_gives_each_outcome_and_the_median_restart_time_per_kind() -> None:
    outcomes = [
        Outcome("worker-0-0", "worker", "restarted", restart_s=2.0),
        Outcome("worker-1-0", "worker", "restarted", restart_s=4.0),
        Outcome("gateway-0", "gateway", "skipped", "shares its process"),
    ]
    result = summary(outcomes)
    assert result["restart_s"] == {"worker": 3.0}
    assert (result["restarted"], result["failed"]) == (2, 0)
    assert [a["result"] for a in result["actors"]] == ["restarted", "restarted", "skipped"]  # type: ignore[attr-defined]
