"""The engine core's fault sentinel, through real engine cores and workers on the in-memory bus
and on a real nats-server: a fault ends every request resumable and leaves the engine core
UNHEALTHY with the fault's description until a ``retry`` (only accepted then) brings it back;
a worker that dies while the engine core is idle makes it DEAD within seconds, and UNHEALTHY
once a new worker is up; no retry within the recovery timeout restarts it; with fault
tolerance off, a fault fails the requests and the engine core serves again by itself."""

from __future__ import annotations

import pytest

from shoal.bus.messages.control import ActorState
from shoal.bus.messages.sampling import SamplingParams
from shoal.workers.actor import WorkerActor
from tests.integration.conditions import core_is_settled, wait_for
from tests.integration.engine_stack import engine_stack
from tests.integration.fault_tools import BareClient, inject_engine_fault, send_instruction

pytestmark = pytest.mark.timeout(180)

PROMPT = [5, 17, 42, 7, 99, 3, 12, 8]
NO_RESUME = {"enable_fault_tolerance": True, "enable_request_resumption": False}


async def _greedy(client, prompt: list[int], max_tokens: int, request_id: str) -> list[int]:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    final = None
    async for output in client.generate(prompt, params, request_id):
        final = output
    assert final is not None and final.outputs[0].finish_reason == "length"
    return list(final.outputs[0].token_ids)


def _reason(stack, engine_id: str) -> str:  # type: ignore[no-untyped-def]
    peer = stack.client.router.liveness.get(engine_id)
    return "" if peer is None else peer.reason


async def test_injected_fault_aborts_resumable_then_retry_recovers(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    bus = await bus_factory()
    async with engine_stack(bus, tiny_checkpoint("llama"), **NO_RESUME) as stack:
        engine, subjects = stack.engines[0], stack.engines[0].subjects
        before = await _greedy(stack.client, PROMPT, 24, "before")
        bare = await BareClient(bus, subjects).start()
        armed = await inject_engine_fault(bus, subjects, "e0", after_steps=3)
        assert armed.at_step == engine.num_steps_sent + 3
        await bare.add("e0", "victim", PROMPT, 500)
        await wait_for(lambda: bare.final("victim") is not None, 30, "victim ended")
        final = bare.final("victim")
        assert final is not None
        assert (final.finish_reason, final.resumable) == ("error", True), final
        assert "injected fault" in (final.error or "")
        assert len(bare.token_ids("victim")) < 500
        assert engine.state is ActorState.UNHEALTHY
        await wait_for(lambda: "injected fault" in _reason(stack, "e0"), 10, "fault_info seen")
        assert stack.client.router.liveness.get("e0").state is ActorState.UNHEALTHY  # type: ignore[union-attr]
        # Unavailable while faulted: an add is refused, not queued.
        await bare.add("e0", "refused", PROMPT, 4)
        await wait_for(lambda: "refused" in bare.rejected, 10, "add refused")
        assert bare.rejected["refused"].code == "unavailable"
        result = await send_instruction(bus, subjects, "e0")
        assert (result.success, result.reason) == (True, None)
        assert engine.state is ActorState.READY
        assert engine.sentinel.num_faults == engine.sentinel.num_recoveries == 1
        await wait_for(lambda: stack.client.is_ready(), 10, "client sees the engine ready")
        assert await _greedy(stack.client, PROMPT, 24, "after") == before
        core = engine.core
        assert core is not None
        await wait_for(lambda: core_is_settled(core), 10, "engine core settled")


async def test_retry_is_rejected_unless_unhealthy(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    bus = await bus_factory()
    async with engine_stack(bus, tiny_checkpoint("llama"), **NO_RESUME) as stack:
        subjects = stack.engines[0].subjects
        healthy = await send_instruction(bus, subjects, "e0")
        assert not healthy.success and "is healthy" in (healthy.reason or "")
        unknown = await send_instruction(bus, subjects, "e0", instruction="pause")
        assert not unknown.success and "Unknown instruction 'pause'" in (unknown.reason or "")
        assert stack.engines[0].state is ActorState.READY


async def test_ft_off_rejects_commands_and_recovers_by_itself(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    bus = await bus_factory()
    async with engine_stack(bus, tiny_checkpoint("llama"), enable_fault_tolerance=False) as stack:
        engine, subjects = stack.engines[0], stack.engines[0].subjects
        bare = await BareClient(bus, subjects).start()
        await inject_engine_fault(bus, subjects, "e0", after_steps=2)
        await bare.add("e0", "victim", PROMPT, 500)
        await wait_for(lambda: bare.final("victim") is not None, 30, "victim ended")
        final = bare.final("victim")
        assert final is not None and (final.finish_reason, final.resumable) == ("error", False)
        await wait_for(lambda: engine.state is ActorState.READY, 30, "ready again by itself")
        result = await send_instruction(bus, subjects, "e0")
        assert not result.success and "fault tolerance is off" in (result.reason or "")
        assert len(await _greedy(stack.client, PROMPT, 8, "after")) == 8


async def test_idle_engine_notices_a_dead_worker_then_recovers(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    bus = await bus_factory()
    model_dir = tiny_checkpoint("llama")
    async with engine_stack(bus, model_dir, worker_dead_after_s=1.0, **NO_RESUME) as stack:
        engine, subjects = stack.engines[0], stack.engines[0].subjects
        before = await _greedy(stack.client, PROMPT, 16, "before")
        await stack.workers[0].stop("killed by the test")
        # Idle: no request runs, yet the engine core notices within seconds.
        await wait_for(lambda: engine.state is ActorState.DEAD, 10, "engine core DEAD")
        assert "w0" in engine.sentinel.fault_info
        rejected = await send_instruction(bus, subjects, "e0")
        assert not rejected.success and "is dead" in (rejected.reason or "")
        replacement = WorkerActor(bus, "w0", config=engine.config, heartbeat_interval_s=0.2)
        await replacement.start()
        stack.workers[0] = replacement
        await wait_for(lambda: engine.state is ActorState.UNHEALTHY, 10, "UNHEALTHY again")
        assert (await send_instruction(bus, subjects, "e0")).success
        await wait_for(lambda: stack.client.is_ready(), 10, "client sees the engine ready")
        assert await _greedy(stack.client, PROMPT, 16, "after") == before


async def test_no_retry_in_time_restarts_the_engine_in_place(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    bus = await bus_factory()
    options = {**NO_RESUME, "engine_recovery_timeout_sec": 1}
    async with engine_stack(bus, tiny_checkpoint("llama"), **options) as stack:
        engine, subjects = stack.engines[0], stack.engines[0].subjects
        incarnation = engine.incarnation
        bare = await BareClient(bus, subjects).start()
        await inject_engine_fault(bus, subjects, "e0")
        await bare.add("e0", "victim", PROMPT, 500)
        await wait_for(lambda: bare.final("victim") is not None, 30, "victim ended")
        await wait_for(lambda: engine.state is ActorState.READY, 30, "serving again")
        assert engine.incarnation != incarnation  # its clients see a restart
        assert engine.sentinel.num_faults == 1
        await wait_for(lambda: stack.client.is_ready(), 10, "client sees the engine ready")
        assert len(await _greedy(stack.client, PROMPT, 8, "after")) == 8
