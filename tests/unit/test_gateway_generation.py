"""``gateway.generation.Generation.close`` under cancellation: a caller cancelled while the close
waits (a client hanging up just then) still leaves the accounting settled and the engine request
aborted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from shoal.bus.messages.sampling import SamplingParams
from shoal.engine.client.outputs import RequestOutput
from shoal.gateway.generation import Generation
from shoal.gateway.metrics import Metrics
from shoal.gateway.params import Prompt
from tests.integration.conditions import wait_for
from tests.unit.test_gateway_fake import FakeEngineClient


class SlowAbortEngine:
    """The fake engine behind an abort that waits for ``gate``, as a bus publish may: both the
    abort in the stream's ``finally`` (the real client's) and an explicit ``abort``."""

    def __init__(self) -> None:
        self.inner = FakeEngineClient(token_delay=0.01)
        self.gate = asyncio.Event()
        self.num_waiting = 0
        self.aborted: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str, **kwargs: object
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            async for output in self.inner.generate(prompt, params, request_id):
                finished = output.finished
                yield output
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self.num_waiting += 1
        await self.gate.wait()
        self.aborted.append(request_id)


def _success(metrics: Metrics, reason: str) -> float | None:
    labels = {"model_name": "m", "finished_reason": reason}
    return metrics.registry.get_sample_value("vllm:request_success_total", labels)


async def test_close_cancelled_while_it_waits_still_settles_and_aborts() -> None:
    engine = SlowAbortEngine()
    metrics = Metrics("m")
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    generation = Generation(engine, [Prompt([5, 6, 7])], [params], "r", metrics)  # type: ignore[arg-type]
    generation.start()
    outputs = generation.outputs()
    await anext(outputs)
    await outputs.aclose()
    assert metrics.num_in_flight == 1
    closing = asyncio.create_task(generation.close())
    await wait_for(lambda: engine.num_waiting > 0, 5.0, "the close waiting on the abort")
    closing.cancel()  # the client hangs up just then
    await asyncio.wait([closing])
    assert closing.cancelled()
    assert metrics.num_in_flight == 0
    assert _success(metrics, "abort") == 1.0
    engine.gate.set()
    await wait_for(lambda: engine.aborted, 5.0, "the abort delivered")
    assert engine.aborted[0] == "r-0"
