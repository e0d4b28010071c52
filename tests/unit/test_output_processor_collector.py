"""The per-request collector: never blocks the producer, merges piled-up outputs, raises errors."""

from __future__ import annotations

import asyncio

import pytest

from shoal.bus.messages.sampling import OutputKind
from shoal.engine.client.collector import RequestOutputCollector
from shoal.engine.client.outputs import CompletionOutput, Logprob, RequestOutput


def output(
    *completions: tuple[int, str, list[int]], finished: bool = False, with_logprobs: bool = False
) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1],
        outputs=[
            CompletionOutput(
                index=i,
                text=text,
                token_ids=list(ids),
                logprobs=[{t: Logprob(-1.0)} for t in ids] if with_logprobs else None,
                finish_reason="length" if finished else None,
            )
            for i, text, ids in completions
        ],
        finished=finished,
    )


async def test_delta_outputs_that_pile_up_are_concatenated() -> None:
    collector = RequestOutputCollector(OutputKind.DELTA)
    collector.put(output((0, "he", [1]), with_logprobs=True))
    collector.put(output((1, "x", [9]), (0, "llo", [2, 3]), with_logprobs=True))
    collector.put(output((0, "!", [4]), finished=True, with_logprobs=True))
    merged = await collector.get()
    assert merged.finished
    assert [(c.index, c.text, c.token_ids) for c in merged.outputs] == [
        (0, "hello!", [1, 2, 3, 4]),
        (1, "x", [9]),
    ]
    assert merged.outputs[0].logprobs is not None and len(merged.outputs[0].logprobs) == 4
    assert merged.outputs[0].finish_reason == "length"
    assert collector.get_nowait() is None


async def test_cumulative_outputs_replace_by_index() -> None:
    collector = RequestOutputCollector(OutputKind.CUMULATIVE)
    collector.put(output((0, "he", [1]), (1, "a", [5])))
    collector.put(output((0, "hello", [1, 2])))
    merged = collector.get_nowait()
    assert merged is not None
    assert [(c.index, c.text) for c in merged.outputs] == [(0, "hello"), (1, "a")]


async def test_get_waits_for_the_producer() -> None:
    collector = RequestOutputCollector(OutputKind.DELTA)
    getter = asyncio.create_task(collector.get())
    await asyncio.sleep(0)
    assert not getter.done()
    collector.put(output((0, "hi", [1])))
    got = await asyncio.wait_for(getter, timeout=5)
    assert got.outputs[0].text == "hi"


async def test_an_exception_is_delivered_and_replaces_pending_output() -> None:
    collector = RequestOutputCollector(OutputKind.DELTA)
    collector.put(output((0, "hi", [1])))
    collector.put(RuntimeError("engine core died"))
    collector.put(output((0, "late", [2])))  # dropped behind the error
    with pytest.raises(RuntimeError, match="engine core died"):
        await collector.get()
    assert collector.get_nowait() is None


def test_producer_never_blocks_without_a_running_loop() -> None:
    collector = RequestOutputCollector(OutputKind.DELTA)
    for i in range(1000):
        collector.put(output((0, "a", [i])))
    merged = collector.get_nowait()
    assert merged is not None and len(merged.outputs[0].token_ids) == 1000
