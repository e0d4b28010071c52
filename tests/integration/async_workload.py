"""The workload the async-scheduling tests run with async on and off and compare: greedy outputs
of a batch with mixed lengths, a long prompt prefilled in chunks, ``n > 1``, a seeded sampled
request, stop strings, stop tokens, prefix-cache hits, and an abort in the middle of it all."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from tests.fixtures.models import make_prompts
from tests.integration.conditions import pick_stop_string, read_then_hang_up, wait_for
from tests.integration.engine_stack import engine_stack

# Only the engine-facing shape matters here: (token ids, finish reason) per completion.
Completions = list[tuple[list[int], str | None]]
Results = dict[str, Completions]

MAX_TOKENS = (2, 5, 9, 14, 20, 3, 17, 11)  # one per make_prompts() prompt
LONG_PROMPT = make_prompts((300,), seed=3)[0]  # several chunks at a 64-token budget
PREFIX = make_prompts((64,), seed=4)[0]  # four full 16-token blocks


def greedy(max_tokens: int, **more: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **more)


async def complete(client: Any, prompt: Any, params: SamplingParams, request_id: str) -> Any:
    """The final output of one request."""
    final = None
    async for output in client.generate(prompt, params, request_id):
        final = output
    assert final is not None and final.finished, request_id
    return final


def completions(final: Any) -> Completions:
    return [(list(c.token_ids), c.finish_reason) for c in final.outputs]


async def run_batch(client: Any, tag: str = "", victim_tokens: int = 900) -> Results:
    """The mixed batch, all at once, with a victim aborted mid-generation among them."""
    mixed = zip(make_prompts(), MAX_TOKENS, strict=True)
    requests: dict[str, tuple[Any, SamplingParams]] = {
        f"mix{i}": (p, greedy(m)) for i, (p, m) in enumerate(mixed)
    }
    requests["long"] = (LONG_PROMPT, greedy(12))
    requests["n3"] = ([11, 12, 13, 14], greedy(9, n=3))
    requests["seeded"] = ([21, 22, 23], SamplingParams(temperature=1.0, seed=7, max_tokens=10))
    victim = read_then_hang_up(client.generate([5, 6, 7], greedy(victim_tokens), f"victim{tag}"))
    finals = await asyncio.gather(
        *(complete(client, p, sp, f"{rid}{tag}") for rid, (p, sp) in requests.items()), victim
    )
    return {rid: completions(f) for rid, f in zip(requests, finals, strict=False)}


async def run_stops(client: Any, tag: str = "") -> Results:
    """A stop string and a stop token found in a first greedy run, then cut runs, together."""
    prompt = [31, 32, 33, 34, 35]
    first = await complete(client, prompt, greedy(24), f"full{tag}")
    tokens = list(first.outputs[0].token_ids)
    stop_token = tokens[6]
    stop_string = pick_stop_string(first.outputs[0].text)
    cut = await asyncio.gather(
        complete(client, prompt, greedy(24, stop=[stop_string]), f"stopstr{tag}"),
        complete(client, prompt, greedy(24, stop_token_ids=[stop_token]), f"stoptok{tag}"),
        complete(client, prompt, greedy(24, stop_token_ids=[stop_token], n=2), f"stoptok2{tag}"),
    )
    results = {"full": completions(first)}
    results.update(zip(("stopstr", "stoptok", "stoptok2"), map(completions, cut), strict=True))
    # Never one token late: the stop token is the last one, at its first occurrence.
    want = tokens[: tokens.index(stop_token) + 1]
    assert results["stoptok"] == [(want, "stop")], results["stoptok"]
    assert results["stopstr"][0][1] == "stop", results["stopstr"]
    return results


async def run_prefix_hits(client: Any, tag: str = "") -> Results:
    """Two prompts sharing four blocks, one after the other: the second hits the cache."""
    first = await complete(client, [*PREFIX, 7, 8], greedy(6), f"pfx1{tag}")
    second = await complete(client, [*PREFIX, 9, 10, 11], greedy(6), f"pfx2{tag}")
    return {"pfx1": completions(first), "pfx2": completions(second)}


async def settled_stats(published: Any) -> Any:
    """The engine core's published stats once it is idle after the workload (the prefix runs,
    the only cache hits, come last)."""

    def settled() -> bool:
        s = published.stats
        idle = (s.num_running, s.num_waiting, s.num_steps_in_flight) == (0, 0, 0)
        return idle and s.prefix_cache_hits > 0

    await wait_for(settled, 60, "the engine core settles")
    return published.stats


async def run_in_one_process(
    model_dir: Any, options: dict[str, int], workload: Callable[[Any], Awaitable[Results]]
) -> Results:
    """``workload`` on a plain engine (async scheduling off, no speculation) in this process,
    on the in-memory bus, with the process deployment's ``options``: the reference outputs."""
    memory = InMemoryBus(InMemoryBroker())
    await memory.connect()
    try:
        async with engine_stack(
            memory,
            model_dir,
            async_scheduling=False,
            num_blocks=options["num_gpu_blocks_override"],
            max_num_seqs=options["max_num_seqs"],
            max_num_batched_tokens=options["max_num_batched_tokens"],
        ) as stack:
            return await workload(stack.client)
    finally:
        await memory.close()


async def run_all(client: Any, tag: str = "") -> Results:
    results = await run_batch(client, tag)
    results.update(await run_stops(client, tag))
    results.update(await run_prefix_hits(client, tag))
    return results
