"""Where the recovery controller is planned: once per deployment, after the engine cores, only
with fault tolerance on and the controller not turned off; ``shoal actor recovery`` finds it,
and the plan's kwargs survive the trip to a supervised process."""

from __future__ import annotations

import msgspec
import pytest

from shoal.bus.runtime.run_actor import build_actor, load_target
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.deploy.actors import actor_target
from shoal.deploy.cli import build_parser
from shoal.deploy.deployment import RECOVERY_TARGET, build_config, plan_actors
from shoal.engine.recovery.actor import RecoveryControllerActor


@pytest.mark.parametrize(
    ("options", "planned"),
    [
        ({}, True),  # fault tolerance is on by default
        ({"enable_fault_tolerance": True}, True),
        ({"enable_fault_tolerance": True, "enable_recovery_controller": False}, False),
        ({"enable_fault_tolerance": False, "enable_recovery_controller": True}, False),
        ({"fault_tolerance_config": {"recovery_max_retries": 2}}, True),
    ],
)
def test_the_controller_is_planned_only_with_fault_tolerance_and_the_controller_on(
    tmp_path, options, planned
):
    config = build_config(model=str(tmp_path), data_parallel_size=2, **options)
    plans = plan_actors(config)
    recovery = [p for p in plans if p.kind == "recovery"]
    assert len(recovery) == int(planned)
    if planned:
        assert plans[-1] is recovery[0]  # after both engine cores
        assert [p.kind for p in plans[:-1]] == ["worker", "engine"] * 2
        assert (recovery[0].name, recovery[0].target) == ("recovery-0", RECOVERY_TARGET)


def test_shoal_actor_recovery_resolves_to_the_planned_controller(tmp_path):
    model = str(tmp_path)
    ns = build_parser().parse_args(["actor", "recovery", model, "--enable-fault-tolerance"])
    config = build_config(model=model, enable_fault_tolerance=True)
    target, kwargs = actor_target(ns.kind, config, ns.actor_id, ns)
    assert target == RECOVERY_TARGET and kwargs["actor_id"] == "recovery-0"
    with pytest.raises(ValueError, match="no recovery named"):
        actor_target("recovery", build_config(model=model, enable_fault_tolerance=False), None, ns)


def test_the_planned_kwargs_build_the_controller_in_another_process(tmp_path):
    config = build_config(
        model=str(tmp_path), fault_tolerance_config={"recovery_max_retries": 2}, namespace="p"
    )
    (plan,) = [p for p in plan_actors(config) if p.kind == "recovery"]
    sent = msgspec.json.decode(msgspec.json.encode(plan.kwargs))  # as the supervisor passes them
    actor = build_actor(load_target(plan.target), InMemoryBus(InMemoryBroker()), sent)
    assert isinstance(actor, RecoveryControllerActor)
    assert actor.actor_id == "recovery-0" and actor.subjects.namespace == "p"
    assert actor.policy.limits.max_retries == 2
