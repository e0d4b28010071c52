"""The gateway over the real engine (worker, engine core, engine client; in-memory bus) under
load and as /metrics counts it: 64 concurrent greedy streams each equal to the same request run
alone (a chunk delivered to the wrong stream fails), and the request, token and finish-reason
counters equal what was sent and received."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from tests.integration.conditions import core_is_settled, pick_stop_string, wait_for
from tests.integration.served_stack import complete, served_stack

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
NUM_STREAMS = 64
EARLY_EOS_PROMPT = [60, 12, 186]  # greedy on the tiny llama: [274, 2] (eos second)


def distinct_prompts(count: int, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 20, (count,), generator=gen).tolist()
    return [torch.randint(4, 320, (n,), generator=gen).tolist() for n in lengths]


async def test_64_concurrent_streams_each_equal_the_request_run_alone(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    prompts = distinct_prompts(NUM_STREAMS)
    options = {"max_num_seqs": NUM_STREAMS, "num_blocks": 512}
    async with served_stack(tiny_checkpoint("llama"), **options) as served:
        url, stack = served.url, served.stack
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


def read_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a /metrics page by (name, labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def tiny(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset({"model_name": "tiny", **labels}.items())


async def test_metrics_count_what_was_sent_and_received(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Requests ending by length, by a stop string, by eos and by a client disconnect: the
    success counters by reason and the token counters equal the answers' own usage."""
    async with served_stack(tiny_checkpoint("llama")) as served:
        url, stack, metrics = served.url, served.stack, served.metrics
        core = stack.engines[0].core
        assert core is not None
        greedy = {"temperature": 0, "ignore_eos": True}
        finished = []  # (answer, wanted finish reason)
        async with aiohttp.ClientSession() as session:
            full = await complete(
                session, url, {**greedy, "prompt": "a long story", "max_tokens": 40}
            )
            finished.append((full, "length"))
            for i, prompt in enumerate(distinct_prompts(3)):
                body = {**greedy, "prompt": prompt, "max_tokens": 5 + 2 * i}
                if i == 1:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                finished.append((await complete(session, url, body), "length"))
            stop = pick_stop_string(full.text)
            body = {**greedy, "prompt": "a long story", "max_tokens": 400, "stop": [stop]}
            finished.append((await complete(session, url, body), "stop"))
            eos = {"temperature": 0, "prompt": EARLY_EOS_PROMPT, "max_tokens": 10}
            finished.append((await complete(session, url, eos), "stop"))
        # A client that hangs up mid-stream: its request ends as aborted.
        victim_prompt = [7, 8, 9, 10]
        victim = {**greedy, "prompt": victim_prompt, "max_tokens": 900, "stream": True}
        async with aiohttp.ClientSession() as session:
            response = await session.post(url + "/v1/completions", json=victim)
            for _ in range(3):
                assert (await response.content.readline()).startswith(b"data: ")
                await response.content.readline()
        await wait_for(lambda: metrics.num_in_flight == 0, 60, "every request counted")
        await wait_for(lambda: core_is_settled(core), 60, "the engine core idle")
        engine_generated = core.stats().num_generation_tokens
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
            samples = read_metrics(await response.text())
    assert [a.finish_reason for a, _ in finished] == [want for _, want in finished]
    reasons = {
        r: samples[tiny("vllm:request_success_total", finished_reason=r)]
        for r in ("length", "stop", "abort", "error")
    }
    assert reasons == {"length": 4, "stop": 2, "abort": 1, "error": 0}
    prompt_tokens = sum(a.usage["prompt_tokens"] for a, _ in finished) + len(victim_prompt)
    assert samples[tiny("vllm:prompt_tokens_total")] == prompt_tokens
    assert samples[tiny("vllm:request_prompt_tokens_sum")] == prompt_tokens
    answered = sum(a.usage["completion_tokens"] for a, _ in finished)
    assert [a.usage["completion_tokens"] for a, _ in finished][-1] == 2  # eos counts, as in vLLM
    # The victim's tokens: at least the 3 chunks its client read, at most what the engine made
    # beyond the answered requests' tokens.
    victim_tokens = samples[tiny("vllm:generation_tokens_total")] - answered
    assert 3 <= victim_tokens <= engine_generated - answered, (victim_tokens, engine_generated)
    assert samples[tiny("vllm:request_generation_tokens_sum")] == answered + victim_tokens
    assert samples[tiny("vllm:e2e_request_latency_seconds_count")] == len(finished) + 1
    assert samples[tiny("shoal:gateway_requests_in_flight")] == 0
