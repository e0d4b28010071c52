"""The engine client's fault-tolerance API against stand-in engine cores on the in-memory bus:
``apply`` reaches every known engine core at once on its control subject, returns each one's
result and records the failures (a rejection, an engine core that does not answer), a later
success clears the record; ``observe`` tells listeners of status changes only."""

from __future__ import annotations

import asyncio

from shoal.bus.codec import Codec, encode
from shoal.bus.messages.control import ActorState, StatusEvent
from shoal.bus.messages.fault import EngineControl, FaultToleranceRequest, FaultToleranceResult
from shoal.bus.msg import Msg
from shoal.bus.subjects import Subjects
from shoal.bus.transport.memory import InMemoryBus
from shoal.engine.client.fault_tolerance import FaultTolerance
from shoal.engine.client.router import EngineRouter

SUBJECTS = Subjects("ftclient")
CONTROL: Codec[EngineControl] = Codec(EngineControl)
LIMIT_S = 5.0


class StandIn:
    """Answers ``retry`` on an engine core's control subject: accepted while ``unhealthy``,
    after every stand-in has the command (they are asked at once, not one by one)."""

    def __init__(self, engine_id: str, arrived: asyncio.Barrier) -> None:
        self.engine_id = engine_id
        self.unhealthy = False
        self.arrived = arrived
        self.requests: list[FaultToleranceRequest] = []

    async def on_control(self, msg: Msg) -> None:
        request = CONTROL.decode(msg.data)
        assert isinstance(request, FaultToleranceRequest)
        self.requests.append(request)
        await asyncio.wait_for(self.arrived.wait(), LIMIT_S)
        if self.unhealthy:
            self.unhealthy = False
            result = FaultToleranceResult(request.request_id, True)
        else:
            result = FaultToleranceResult(request.request_id, False, "status is healthy")
        await msg.respond(encode(result))


def _report(router: EngineRouter, engine_id: str, state: ActorState, reason: str = "") -> None:
    router.liveness.on_event(StatusEvent(engine_id, "engine", state, 0.0, reason, "i1"))


async def test_apply_reaches_every_engine_core_at_once_and_records_failures() -> None:
    bus = InMemoryBus()
    await bus.connect()
    router = EngineRouter()
    ft = FaultTolerance(bus, SUBJECTS, router, command_timeout_s=LIMIT_S)
    arrived = asyncio.Barrier(2)
    stand_ins = {e: StandIn(e, arrived) for e in ("e0", "e1")}
    for engine_id, stand_in in stand_ins.items():
        await bus.subscribe(SUBJECTS.control("engine", engine_id), stand_in.on_control)
    _report(router, "e0", ActorState.UNHEALTHY, "InjectedFault: boom")
    _report(router, "e1", ActorState.READY)
    _report(router, "e2", ActorState.READY)  # known, but nobody answers on its subject
    stand_ins["e0"].unhealthy = True
    try:
        results = await ft.apply(FaultToleranceRequest("retry", {}, "ft-1"))
        assert {e: r.success for e, r in results.items()} == {"e0": True, "e1": False, "e2": False}
        assert [r.request_id for r in stand_ins["e1"].requests] == ["ft-1"]
        entries = {e.id: e for e in ft.status().engines}
        assert (entries["e0"].last_ft_request_id, entries["e0"].ft_error) == (None, None)
        assert (entries["e1"].last_ft_request_id, entries["e1"].ft_error) == (
            "ft-1",
            "status is healthy",
        )
        assert entries["e2"].last_ft_request_id == "ft-1"
        assert "NoResponders" in (entries["e2"].ft_error or "")

        stand_ins["e1"].unhealthy = True  # a later success clears e1's record
        await ft.apply(FaultToleranceRequest("retry", {}, "ft-2"))
        entries = {e.id: e for e in ft.status().engines}
        assert entries["e1"].ft_error is None
        assert entries["e0"].ft_error == "status is healthy"
        assert entries["e0"].last_ft_request_id == "ft-2"
    finally:
        await bus.close()


async def test_observe_tells_listeners_of_status_changes_only() -> None:
    bus = InMemoryBus()
    router = EngineRouter()
    ft = FaultTolerance(bus, SUBJECTS, router)
    heard: list[tuple[str, str]] = []
    ft.listeners.append(lambda engine_id, status: heard.append((engine_id, status)))
    for state in (ActorState.READY, ActorState.READY, ActorState.UNHEALTHY, ActorState.READY):
        _report(router, "e0", state)
        ft.observe("e0")
    assert heard == [("e0", "healthy"), ("e0", "unhealthy"), ("e0", "healthy")]
