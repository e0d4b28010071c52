"""The gateway over the real engine (worker, engine core, engine client; in-memory bus) under
load and as /metrics counts it: 64 concurrent greedy streams each equal to the same request run
alone (a chunk delivered to the wrong stream fails), and the request, token and finish-reason
counters equal what was sent and received."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from tests.integration.served_stack import complete, served_stack

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
NUM_STREAMS = 64


def distinct_prompts(count: int, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 20, (count,), generator=gen).tolist()
    return [torch.randint(4, 320, (n,), generator=gen).tolist() for n in lengths]


async def test_64_concurrent_streams_each_equal_the_request_run_alone(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    prompts = distinct_prompts(NUM_STREAMS)
    options = {"max_num_seqs": NUM_STREAMS, "num_blocks": 512}
    async with served_stack(tiny_checkpoint("llama"), **options) as (url, stack, _):
        peak_running = 0

        def track(stats, engine_id: str) -> None:  # type: ignore[no-untyped-def]
            nonlocal peak_running
            peak_running = max(peak_running, stats.num_running)

        stack.client.stats_listeners.append(track)
        bodies = [
            {"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
            for p in prompts
        ]
        async with aiohttp.ClientSession() as session:
            together = await asyncio.wait_for(
                asyncio.gather(*(complete(session, url, b) for b in bodies)), 120
            )
            peak_together, peak_running = peak_running, 0
            alone = [await complete(session, url, b) for b in bodies]
    assert peak_together >= 8 and peak_running == 1, (peak_together, peak_running)
    assert len({a.text for a in alone}) > NUM_STREAMS // 2  # outputs differ: a mix-up would show
    for index, (got, want) in enumerate(zip(together, alone, strict=True)):
        assert (got.text, got.finish_reason) == (want.text, "length"), index
        assert got.num_chunks > 1, index
