"""Fatal and non-fatal worker errors through a real engine core with fault tolerance on (the
in-memory bus and NATS): a request whose prompt holds a token id outside the vocabulary fails
alone and the engine core stays READY, serving the others; a fault injected into the worker is
fatal: the engine core turns UNHEALTHY until a retry."""

from __future__ import annotations

import pytest

from shoal.bus.codec import Codec
from shoal.bus.messages.control import ActorState
from shoal.bus.messages.fault import FaultInjected, InjectFault
from shoal.bus.messages.worker import WorkerOutbound
from shoal.bus.runtime.actor import call
from shoal.bus.subjects import Subjects
from tests.fixtures.models import hf_greedy
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import engine_stack
from tests.integration.fault_tools import BareClient, send_instruction

pytestmark = pytest.mark.timeout(180)

VOCAB = 320  # the tiny checkpoints' vocabulary
GOOD = [5, 17, 42, 7, 99, 3]
MAX_TOKENS = 6
WAIT_S = 60.0


async def test_a_request_with_a_bad_token_fails_alone(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    expected = hf_greedy(model_dir, [GOOD], MAX_TOKENS)[0]
    bus = await bus_factory()
    async with engine_stack(bus, model_dir, enable_fault_tolerance=True) as stack:
        subjects = Subjects(stack.engines[0].config.bus_config.namespace)
        bare = await BareClient(bus, subjects).start()
        for i in range(3):  # sent together: they share steps
            await bare.add("e0", f"good{i}", GOOD, MAX_TOKENS)
            await bare.add("e0", f"bad{i}", [5, VOCAB + i, 7], MAX_TOKENS)
        names = [f"{kind}{i}" for kind in ("good", "bad") for i in range(3)]
        await wait_for(lambda: all(bare.final(n) for n in names), WAIT_S, "every request ended")
        for i in range(3):
            bad = bare.final(f"bad{i}")
            assert bad is not None and bad.finish_reason == "error"
            assert f"token id {VOCAB + i} is out of range" in str(bad.error)
            good = bare.final(f"good{i}")
            assert good is not None and good.finish_reason == "length"
            assert bare.token_ids(f"good{i}") == expected
        assert stack.engines[0].state is ActorState.READY  # never left it
        assert stack.workers[0].num_step_errors >= 1  # the refusals came as step errors


async def test_an_injected_worker_fault_is_fatal(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    expected = hf_greedy(model_dir, [GOOD], MAX_TOKENS)[0]
    bus = await bus_factory()
    async with engine_stack(bus, model_dir, enable_fault_tolerance=True) as stack:
        engine = stack.engines[0]
        subjects = Subjects(engine.config.bus_config.namespace)
        bare = await BareClient(bus, subjects).start()
        reply = Codec(WorkerOutbound)
        armed = await call(bus, subjects.worker_in("w0"), InjectFault(0, "boom"), reply, timeout=10)
        assert isinstance(armed, FaultInjected) and armed.actor_id == "w0"
        await bare.add("e0", "victim", GOOD, MAX_TOKENS)
        await wait_for(lambda: bare.final("victim") is not None, WAIT_S, "the victim ended")
        victim = bare.final("victim")
        assert victim is not None and victim.finish_reason == "error"
        assert "InjectedFault: boom" in str(victim.error)
        await wait_for(lambda: engine.state is ActorState.UNHEALTHY, WAIT_S, "UNHEALTHY")
        result = await send_instruction(bus, subjects, "e0")
        assert result.success, result
        await bare.add("e0", "after", GOOD, MAX_TOKENS)
        await wait_for(lambda: bare.final("after") is not None, WAIT_S, "served again")
        assert bare.token_ids("after") == expected
