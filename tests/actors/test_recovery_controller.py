"""The recovery controller against stand-in engine cores (real actors that heartbeat, publish
status events and answer ``retry`` as scripted), on the in-memory bus and on a real NATS
server: it retries an UNHEALTHY engine core until it is READY, backs off after a rejection or a
retry that times out, gives up loudly after its limit, leaves READY engine cores alone, waits
while one is DEAD, and a new controller picks up an engine core that is still UNHEALTHY."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest

from shoal.bus.base import Bus
from shoal.bus.codec import Codec
from shoal.bus.messages.control import ActorState, StatusEvent
from shoal.bus.messages.fault import (
    RETRY,
    EngineControl,
    FaultInjected,
    FaultToleranceRequest,
    FaultToleranceResult,
    InjectFault,
)
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import Actor, Inbox
from shoal.bus.subjects import Subjects
from shoal.config.deployment import ShoalConfig
from shoal.engine.recovery.actor import RecoveryControllerActor
from tests.fixtures.nats import BusFactory
from tests.integration.conditions import wait_for as wait_until

LIMIT_S = 10.0
BACKOFF_S = 0.05
HEARTBEAT_S = 0.05


async def wait_for(condition: Callable[[], object], what: str) -> None:
    await wait_until(condition, LIMIT_S, what)


class StandInEngine(Actor):
    """Heartbeats and status events as an engine core's; answers ``retry`` by its script
    (``accept``: READY, then success; ``reject``; ``hang``: no answer in time), and once the
    script is spent as the contract says: accepted only while UNHEALTHY."""

    kind = "engine"

    def __init__(self, bus: Bus, actor_id: str, namespace: str, script: Sequence[str] = ()):
        super().__init__(
            bus,
            actor_id,
            namespace=namespace,
            drain_timeout_s=0.2,
            heartbeat_interval_s=HEARTBEAT_S,
        )
        self.script = list(script)
        self.retries: list[tuple[float, FaultToleranceRequest]] = []  # (monotonic, request)

    def inboxes(self) -> Sequence[Inbox]:
        subject = self.subjects.control(self.kind, self.actor_id)
        return [Inbox(subject, self.on_control, Codec(EngineControl))]

    async def on_control(self, command: Any, msg: Msg) -> Any:
        if isinstance(command, InjectFault):
            return FaultInjected(self.actor_id, 0)
        self.retries.append((time.monotonic(), command))
        default = "accept" if self.state is ActorState.UNHEALTHY else "reject"
        answer = self.script.pop(0) if self.script else default
        if answer == "hang":
            await asyncio.sleep(1.0)
        if answer == "accept":
            await self.set_state(ActorState.READY, "recovered")
            return FaultToleranceResult(command.request_id, True)
        return FaultToleranceResult(command.request_id, False, f"{answer}: {self.state.name}")


class Deployment:
    """Actors of one test on one bus and namespace; stopped at its end."""

    def __init__(self, bus: Bus, namespace: str) -> None:
        self.bus, self.namespace = bus, namespace
        self.actors: list[Actor] = []
        self.statuses: list[StatusEvent] = []

    async def engine(self, engine_id: str, state: ActorState, *script: str) -> StandInEngine:
        engine = StandInEngine(self.bus, engine_id, self.namespace, script)
        await engine.start()
        self.actors.append(engine)
        if state is not ActorState.READY:
            await engine.set_state(state, f"{engine_id} faulted")
        return engine

    async def controller(self, **options: Any) -> RecoveryControllerActor:
        ft = {"recovery_backoff_s": BACKOFF_S, "recovery_max_backoff_s": 4 * BACKOFF_S, **options}
        config = ShoalConfig.from_options(
            model="unused", namespace=self.namespace, enable_fault_tolerance=True, **ft
        )
        controller = RecoveryControllerActor(
            self.bus,
            config=config,
            retry_timeout_s=0.3,
            tick_s=0.02,
            heartbeat_interval_s=HEARTBEAT_S,
        )
        await controller.start()
        self.actors.append(controller)
        return controller

    async def watch_controller_status(self) -> None:
        codec: Codec[StatusEvent] = Codec(StatusEvent)

        async def on_status(msg: Msg) -> None:
            self.statuses.append(codec.decode(msg.data))

        await self.bus.subscribe(Subjects(self.namespace).status("recovery"), on_status)


@pytest.fixture
async def deployment(bus_factory: BusFactory) -> AsyncIterator[Deployment]:
    d = Deployment(await bus_factory(), f"rc{secrets.token_hex(4)}")
    yield d
    for actor in reversed(d.actors):
        await actor.stop()


async def test_an_unhealthy_engine_core_is_retried_until_ready(deployment):
    engine = await deployment.engine("engine-0", ActorState.UNHEALTHY, "reject", "accept")
    controller = await deployment.controller()
    await wait_for(lambda: engine.state is ActorState.READY, "engine-0 ready again")
    await wait_for(lambda: controller.policy.num_retries_succeeded == 1, "the retry's answer")
    assert [r.instruction for _, r in engine.retries] == [RETRY, RETRY]
    assert len({r.request_id for _, r in engine.retries}) == 2
    load = controller.load()
    assert (load["num_retries_sent"], load["num_retries_failed"]) == (2.0, 1.0)


async def test_rejected_retries_back_off_then_the_controller_gives_up_loudly(deployment, caplog):
    await deployment.watch_controller_status()
    engine = await deployment.engine("engine-0", ActorState.UNHEALTHY, *["reject"] * 9)
    with caplog.at_level(logging.ERROR, logger="shoal.engine.recovery.actor"):
        controller = await deployment.controller(recovery_max_retries=3)
        await wait_for(lambda: controller.policy.num_given_up == 1, "the give-up")
    assert len(engine.retries) == 3
    times = [t for t, _ in engine.retries]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps[0] >= BACKOFF_S and gaps[1] >= 2 * BACKOFF_S, gaps  # doubling waits
    await wait_for(
        lambda: any("gave up on engine-0" in s.reason for s in deployment.statuses),
        "the controller's status event",
    )
    assert any("gave up on engine-0 after 3 retries" in r.message for r in caplog.records)
    assert controller.load()["num_given_up"] == 1.0


async def test_a_retry_without_an_answer_in_time_is_tried_again(deployment):
    engine = await deployment.engine("engine-0", ActorState.UNHEALTHY, "hang", "accept")
    controller = await deployment.controller()
    await wait_for(lambda: engine.state is ActorState.READY, "engine-0 ready again")
    assert len(engine.retries) == 2
    assert controller.policy.num_retries_failed == 1


async def test_ready_and_dead_engine_cores_get_no_retry(deployment):
    ready = await deployment.engine("engine-0", ActorState.READY)
    dead = await deployment.engine("engine-1", ActorState.DEAD)
    controller = await deployment.controller()
    # engine-2, faulted after the controller saw the other two, paces the check
    await wait_for(
        lambda: {"engine-0", "engine-1"} <= controller.policy.engines.keys(), "two engines seen"
    )
    witness = await deployment.engine("engine-2", ActorState.UNHEALTHY)
    await wait_for(lambda: witness.state is ActorState.READY, "engine-2 retried")
    assert ready.retries == [] and dead.retries == []
    # the dead one's workers are back: it turns UNHEALTHY by itself, then gets its retry
    await dead.set_state(ActorState.UNHEALTHY, "worker-1-0 restarted")
    await wait_for(lambda: dead.state is ActorState.READY, "engine-1 retried")
    assert len(dead.retries) == 1 and ready.retries == []


async def test_a_new_controller_picks_up_an_engine_core_still_unhealthy(deployment):
    engine = await deployment.engine("engine-0", ActorState.UNHEALTHY, "reject")
    first = await deployment.controller(recovery_max_retries=1)
    await wait_for(lambda: first.policy.num_given_up == 1, "the first controller gives up")
    await first.stop()
    assert engine.state is ActorState.UNHEALTHY and len(engine.retries) == 1
    # a new controller has only the engine core's heartbeats to go by (its fault's status
    # event went by long ago): that is enough
    second = await deployment.controller(recovery_max_retries=1)
    await wait_for(lambda: engine.state is ActorState.READY, "engine-0 ready again")
    # (the controller counts the success when the retry's reply reaches it, maybe a bit later)
    await wait_for(lambda: second.policy.num_retries_succeeded == 1, "the retry counted")
    assert len(engine.retries) == 2
