"""The worker actor under async scheduling, with the fake runner of ``test_worker_actor``: a
step sent while another runs waits its turn (never rejected) and each result says how long the
worker sat idle before it."""

from __future__ import annotations

import asyncio
import threading

from shoal.bus.messages.worker import StepResult
from tests.actors.test_worker_actor import WAIT_S, Harness, _step, harness

__all__ = ["harness"]  # the fixture, on the in-memory bus and on NATS


async def test_a_step_sent_while_one_runs_is_queued_and_run_next(harness: Harness) -> None:
    harness.runner.gate = threading.Event()
    first = asyncio.create_task(harness.ask(_step(1, "a")))
    assert await asyncio.to_thread(harness.runner.step_started.wait, WAIT_S)
    second = asyncio.create_task(harness.ask(_step(2, cached=("a",))))
    await harness.engine_bus.flush()
    assert not first.done() and not second.done()
    assert harness.runner.step_order == [1]  # step 2 waits while step 1 is held
    harness.runner.gate.set()
    one, two = await asyncio.gather(first, second)
    assert isinstance(one, StepResult) and isinstance(two, StepResult)
    assert (one.error, two.error) == (None, None)
    assert (one.step_id, two.step_id) == (1, 2)
    assert harness.runner.step_order == [1, 2]
    assert one.idle_before_s == 0.0  # the worker's first step: no idle time before it
    assert two.idle_before_s >= 0.0
