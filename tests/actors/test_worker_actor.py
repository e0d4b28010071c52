"""The worker actor shell on the in-memory bus, with a fake model runner: replies, the error
path, heartbeats during a slow step, ordering on one runner thread, reset and describe."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from shoal.bus.base import Bus
from shoal.bus.codec import Codec
from shoal.bus.messages.control import ActorState, Heartbeat
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import (
    CachedRequestData,
    DescribeWorker,
    ExecuteStep,
    NewRequestData,
    ResetDone,
    ResetWorker,
    StepResult,
    WorkerInfo,
    WorkerOutbound,
)
from shoal.bus.runtime.actor import call
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.workers.actor import WorkerActor
from tests.fixtures.nats import BusFactory
from tests.integration.conditions import wait_for

REPLY = Codec(WorkerOutbound)
WAIT_S = 10.0


@dataclass(frozen=True)
class FakeFacts:
    num_blocks: int = 64
    block_size: int = 16
    max_model_len: int = 256
    vocab_size: int = 100
    eos_token_ids: list[int] = field(default_factory=lambda: [2])


class FakeRunner:
    """Keeps request ids, answers token 7 for each, fails on a request named ``boom`` and can
    block on a gate (released by the test) to stand for a long prefill."""

    def __init__(self, fail_load: bool = False) -> None:
        self.requests: set[str] = set()
        self.thread_ids: set[int] = set()
        self.step_order: list[int] = []
        self.fail_load = fail_load
        self.gate: threading.Event | None = None
        self.step_started = threading.Event()

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def load(self) -> FakeFacts:
        self.thread_ids.add(threading.get_ident())
        if self.fail_load:
            raise FileNotFoundError("no config.json in /nowhere")
        return FakeFacts()

    def execute(self, step: ExecuteStep) -> StepResult:
        self.thread_ids.add(threading.get_ident())
        self.step_order.append(step.step_id)
        self.step_started.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        self.requests.difference_update(step.finished_req_ids)
        for new in step.new_requests:
            if new.req_id == "boom":
                raise RuntimeError("CUDA out of memory (fake)")
            self.requests.add(new.req_id)
        req_ids = step.batch_order().req_ids
        return StepResult(step.step_id, req_ids, [[7] for _ in req_ids])

    def reset(self) -> None:
        self.requests.clear()


def _new(req_id: str) -> NewRequestData:
    return NewRequestData(req_id, [1, 2, 3], SamplingParams(), [1], 0, 3)


def _step(step_id: int, *new: str, cached: tuple[str, ...] = ()) -> ExecuteStep:
    return ExecuteStep(
        step_id,
        new_requests=[_new(r) for r in new],
        cached_requests=[CachedRequestData(r, [], 3, 1) for r in cached],
    )


class Harness:
    def __init__(self, runner: FakeRunner, worker_bus: Bus, engine_bus: Bus) -> None:
        self.runner = runner
        self.engine_bus = engine_bus
        self.actor = WorkerActor(
            worker_bus, "w0", runner=runner, engine_id="e0", heartbeat_interval_s=0.01
        )
        self.subject = self.actor.subjects.worker_in("w0")

    async def ask(self, message: object) -> object:
        return await call(self.engine_bus, self.subject, message, REPLY, timeout=WAIT_S)


@pytest.fixture
async def harness(bus_factory: BusFactory) -> AsyncIterator[Harness]:
    """A worker with a fake runner, on the in-memory bus and on NATS (same tests)."""
    h = Harness(FakeRunner(), await bus_factory(), await bus_factory())
    await h.actor.start()
    yield h
    if h.runner.gate is not None:
        h.runner.gate.set()
    await h.actor.stop()


async def test_a_step_is_answered_with_its_result(harness: Harness) -> None:
    result = await harness.ask(_step(1, "a", "b"))
    assert isinstance(result, StepResult)
    assert (result.step_id, result.req_ids, result.sampled_token_ids) == (1, ["a", "b"], [[7], [7]])
    assert result.error is None and result.execute_time_s >= 0.0
    assert harness.actor.load()["num_requests"] == 2
    assert harness.actor.load()["num_blocks"] == 64


async def test_a_failing_step_is_answered_with_an_error_and_the_worker_keeps_serving(
    harness: Harness,
) -> None:
    failed = await harness.ask(_step(1, "a", "boom", cached=("c",)))
    assert isinstance(failed, StepResult) and failed.error is not None
    assert failed.error.req_ids == ["a", "boom", "c"]
    assert "RuntimeError" in failed.error.message and "out of memory" in failed.error.message
    assert "step 1" in failed.error.message
    after = await harness.ask(_step(2, "d"))
    assert isinstance(after, StepResult) and after.error is None
    assert after.sampled_token_ids == [[7]]
    assert harness.actor.load()["num_step_errors"] == 1
    assert harness.actor.state is ActorState.READY


async def test_heartbeats_keep_flowing_during_a_slow_step(harness: Harness) -> None:
    beats: list[Heartbeat] = []
    heartbeat_codec = Codec(Heartbeat)

    async def on_beat(msg: object) -> None:
        beats.append(heartbeat_codec.decode(msg.data))  # type: ignore[attr-defined]

    await harness.engine_bus.subscribe(harness.actor.subjects.heartbeat("worker"), on_beat)
    harness.runner.gate = threading.Event()
    pending = asyncio.create_task(harness.ask(_step(1, "a")))
    assert await asyncio.to_thread(harness.runner.step_started.wait, WAIT_S)
    seen_before = len(beats)
    await wait_for(
        lambda: len([b for b in beats[seen_before:] if b.load.get("step_running") == 1.0]) >= 3,
        WAIT_S,
        "three beats during the step",
    )
    assert not pending.done()  # the step is still blocked while the beats arrived
    harness.runner.gate.set()
    result = await pending
    assert isinstance(result, StepResult) and result.sampled_token_ids == [[7]]


async def test_stop_drains_the_step_in_flight(harness: Harness) -> None:
    harness.runner.gate = threading.Event()
    pending = asyncio.create_task(harness.ask(_step(1, "a")))
    assert await asyncio.to_thread(harness.runner.step_started.wait, WAIT_S)
    stopping = asyncio.create_task(harness.actor.stop("test"))
    await wait_for(lambda: harness.actor.state is ActorState.DRAINING, WAIT_S, "draining")
    assert not stopping.done()  # it waits for the step, held by the gate
    harness.runner.gate.set()
    result = await pending
    assert isinstance(result, StepResult) and result.sampled_token_ids == [[7]]
    await stopping
    assert harness.actor.state is ActorState.STOPPED


async def test_steps_run_in_order_on_one_dedicated_thread(harness: Harness) -> None:
    results: list[StepResult] = []
    result_codec = Codec(StepResult)

    async def on_result(msg: object) -> None:
        results.append(result_codec.decode(msg.data))  # type: ignore[attr-defined]

    await harness.engine_bus.subscribe(harness.actor.subjects.engine_results("e0"), on_result)
    step_codec = Codec(ExecuteStep)
    for step_id in range(1, 6):  # published without a reply subject: results go to e0
        await harness.engine_bus.publish(harness.subject, step_codec.encode(_step(step_id, "a")))
    await wait_for(lambda: len(results) >= 5, WAIT_S, "five results")
    assert [r.step_id for r in results] == [1, 2, 3, 4, 5]
    assert harness.runner.step_order == [1, 2, 3, 4, 5]
    assert len(harness.runner.thread_ids) == 1  # load and every step: the same runner thread
    assert threading.get_ident() not in harness.runner.thread_ids


async def test_describe_and_reset(harness: Harness) -> None:
    info = await harness.ask(DescribeWorker("e0"))
    assert isinstance(info, WorkerInfo)
    assert (info.worker_id, info.num_blocks, info.block_size) == ("w0", 64, 16)
    assert (info.vocab_size, info.eos_token_ids, info.max_model_len) == (100, [2], 256)
    assert info.incarnation == harness.actor.incarnation
    await harness.ask(_step(1, "a", "b"))
    done = await harness.ask(ResetWorker("engine restarted"))
    assert isinstance(done, ResetDone) and done.worker_id == "w0"
    assert harness.runner.requests == set()
    assert harness.actor.load()["num_requests"] == 0


async def test_a_runner_that_fails_to_load_marks_the_worker_dead() -> None:
    broker = InMemoryBroker()
    h = Harness(FakeRunner(fail_load=True), InMemoryBus(broker), InMemoryBus(broker))
    with pytest.raises(FileNotFoundError):
        await h.actor.start()
    assert h.actor.state is ActorState.DEAD
    await h.actor.bus.close()


def test_a_worker_needs_a_config_or_a_runner() -> None:
    with pytest.raises(ValueError, match="config or a runner"):
        WorkerActor(InMemoryBus(), "w0")
