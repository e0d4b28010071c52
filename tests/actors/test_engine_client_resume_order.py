"""The engine client (fault tolerance and resumption on) against a fake engine core on the
in-memory bus: a request cut by a fault (a ``resumable`` error output) waits, parked, while its
engine core is not ready, and goes back to it once it is, whatever order the client hears the
core's status and its outputs in (they travel on different subjects)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from shoal.bus.messages.control import ActorState
from shoal.bus.messages.engine import EngineCoreOutput
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.subjects import Subjects
from shoal.bus.transport.memory import InMemoryBus
from shoal.config.deployment import ShoalConfig
from shoal.engine.client.engine_client import AsyncEngineClient
from tests.actors.fake_engine_core import FakeEngine
from tests.integration.conditions import wait_for

NAMESPACE = "resume-order"
SUBJECTS = Subjects(NAMESPACE)
LIMIT_S = 5.0  # several watchdog rounds, far below the resume timeout
RESUME_TIMEOUT_S = 60.0
PARAMS = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


@pytest.fixture
async def setup(tiny_checkpoint) -> AsyncIterator[tuple[AsyncEngineClient, FakeEngine]]:  # type: ignore[no-untyped-def]
    bus = InMemoryBus()
    await bus.connect()
    config = ShoalConfig.from_options(
        model=str(tiny_checkpoint("llama")),
        namespace=NAMESPACE,
        enable_fault_tolerance=True,
        request_resume_timeout_s=RESUME_TIMEOUT_S,
    )
    engine = FakeEngine(bus, SUBJECTS, "e0")
    client = AsyncEngineClient(bus, config)
    await client.start()
    await engine.start()
    await engine.stats("a")
    await client.wait_until_ready(LIMIT_S)
    yield client, engine
    await client.close()
    await bus.close()


async def cut_by_a_fault(client: AsyncEngineClient, engine: FakeEngine) -> None:
    """The engine core's sentinel ends request "r" as resumable."""
    fault = EngineCoreOutput("r", [], "error", error="injected fault", resumable=True)
    await engine.outputs(client.client_id, [fault])
    await wait_for(lambda: client.resumptions.num_resumptions_total == 1, LIMIT_S, "r parked")


async def heard(client: AsyncEngineClient, engine: FakeEngine, state: ActorState) -> None:
    await engine.status(state)
    ready = state is ActorState.READY
    await wait_for(lambda: client.router.is_ready("e0") == ready, LIMIT_S, f"{state.name} heard")


@pytest.mark.parametrize("order", ["fault, ready, cut", "cut, ready"])
async def test_a_request_cut_goes_back_to_its_core_on_a_ready_heard_as_no_change(  # type: ignore[no-untyped-def]
    setup, order: str
) -> None:
    """The core's fault and its READY after a quick retry both arrive before the resumable
    output ("fault, ready, cut"), or its fault's status went with a dropped bus connection and
    its READY looks like no change ("cut, ready"): either way the request must not wait out
    the resume timeout for a READY the client will not hear as new."""
    client, engine = setup
    await client.add_request([5, 6, 7], PARAMS, "r")
    await wait_for(lambda: list(engine.adds) == ["r"], LIMIT_S, "r sent")
    if order == "fault, ready, cut":
        await heard(client, engine, ActorState.UNHEALTHY)
        await heard(client, engine, ActorState.READY)
        await cut_by_a_fault(client, engine)
    else:
        await cut_by_a_fault(client, engine)
        await heard(client, engine, ActorState.READY)
    await wait_for(lambda: "r@1" in engine.adds, LIMIT_S, "r resumed on e0 under a fresh id")
    assert "r" in engine.aborts  # the old attempt
    assert not client.resumptions.parked


async def test_a_request_cut_waits_while_its_core_is_unhealthy_then_goes_back(setup) -> None:  # type: ignore[no-untyped-def]
    client, engine = setup
    await client.add_request([5, 6, 7], PARAMS, "r")
    await wait_for(lambda: list(engine.adds) == ["r"], LIMIT_S, "r sent")
    await heard(client, engine, ActorState.UNHEALTHY)
    await cut_by_a_fault(client, engine)
    await asyncio.sleep(2.5)  # two watchdog rounds: the core is not ready, nothing is sent
    assert list(engine.adds) == ["r"] and "r" in client.resumptions.parked
    await heard(client, engine, ActorState.READY)
    await wait_for(lambda: "r@1" in engine.adds, LIMIT_S, "r resumed on e0 under a fresh id")
