"""Many clients hanging up at random points of their streams, through the real engine: after
every round the gateway's in-flight count (``/load``) is back to 0, every completion it started
is counted as finished (by some reason), and the engine core is idle with its KV blocks free.

A hang-up can cancel a handler twice: a write fails on the closing connection, the handler
starts cleaning up, and aiohttp's ``connection_lost`` then cancels it while that cleanup waits.
The HTTP test meets this by chance (seeded clients on their own event loop); the second test
cancels generations twice at random points on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import aiohttp
import pytest

from shoal.bus.messages.sampling import SamplingParams
from shoal.gateway.generation import Generation
from shoal.gateway.params import Prompt
from tests.integration.served_stack import ServedStack, served_stack, with_chat_template

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

NUM_CLIENTS = 64
NUM_ROUNDS = 6
PROMPTS = ["the quick brown fox", "paged attention reads", "shoal serves tiny", "0123 + 45"]


async def _client(session: aiohttp.ClientSession, url: str, rng: random.Random) -> None:
    """One client: a completion or chat, streamed or not, dropped at a random moment or after a
    random number of lines (or read to the end). The moments are random, not waited for."""
    max_tokens = rng.randint(1, 24)
    body: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, "n": rng.choice([1, 2])}
    prompt = rng.choice(PROMPTS)
    if rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", prompt
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    body["stream"] = rng.random() < 0.85
    num_lines = rng.randint(0, 2 * (max_tokens + 3))  # beyond the end: read it all
    try:
        response = await session.post(url + path, json=body)
    except aiohttp.ClientError:
        return
    try:
        if not body["stream"] or rng.random() < 0.5:  # hang up at a random moment
            await asyncio.wait_for(response.read(), timeout=rng.random() * 0.3)
            return
        for _ in range(num_lines):  # or after a random number of lines
            if not await response.content.readline():
                return
    except (TimeoutError, aiohttp.ClientError):
        return
    finally:
        response.close()  # drops the connection unless the body was read to the end


async def _round(served: ServedStack, seed: int) -> None:
    """``NUM_CLIENTS`` clients at once. Run it on an event loop of its own (``_round_apart``)."""
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        seeds = [rng.random() for _ in range(NUM_CLIENTS)]
        await asyncio.gather(*(_client(session, served.url, random.Random(s)) for s in seeds))


async def _round_apart(served: ServedStack, seed: int) -> None:
    """A round with the clients on an event loop of their own (a thread), so that their hang-ups
    land at moments unrelated to the server loop's turns, as real clients' do. Sharing the
    server's loop, a client only ever hung up right after reading a write, while the handler sat
    idle waiting for the next output, and the leak never showed."""
    await asyncio.to_thread(asyncio.run, _round(served, seed))


async def _load(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url + "/load") as response:
        return int((await response.json())["server_load"])


async def test_random_disconnects_leave_nothing_in_flight(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model")
    async with served_stack(model_dir) as served:
        for seed in range(NUM_ROUNDS):
            await _round_apart(served, seed)
            await served.wait_until_idle()
            async with aiohttp.ClientSession() as session:
                assert await _load(session, served.url) == 0
        assert served.num_started() > NUM_CLIENTS * NUM_ROUNDS  # n = 2 for some
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "hello", "max_tokens": 3, "ignore_eos": True}
            async with session.post(served.url + "/v1/completions", json=body) as response:
                assert response.status == 200
                assert (await response.json())["choices"][0]["finish_reason"] == "length"
            assert await _load(session, served.url) == 0


async def _consume(served: ServedStack, request_id: str, num_outputs: int) -> None:
    """A handler's part: run a generation and read ``num_outputs`` of its outputs."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, n=1 + num_outputs % 2)
    prompt = Prompt([5 + num_outputs, 6, 7])
    generation = Generation(served.stack.client, [prompt], [params], request_id, served.metrics)
    async with generation:
        outputs = generation.outputs()
        async with contextlib.aclosing(outputs):
            for _ in range(num_outputs):
                if await anext(outputs, None) is None:
                    return


async def _hang_up(task: asyncio.Task[None], rng: random.Random) -> None:
    """Cancel ``task`` after a random number of loop turns, then once more a few turns later,
    as aiohttp does when a write fails on a closing connection and ``connection_lost`` follows
    while the handler cleans up. The yields pick the point; they wait for nothing."""
    for _ in range(rng.randint(0, 60)):
        await asyncio.sleep(0)
    task.cancel()
    for _ in range(rng.randint(0, 4)):
        await asyncio.sleep(0)
    task.cancel()


async def test_cancellations_during_cleanup_leave_nothing_in_flight(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    async with served_stack(tiny_checkpoint("llama")) as served:
        for seed in range(NUM_ROUNDS):
            rng = random.Random(seed)
            tasks = [
                asyncio.create_task(_consume(served, f"r{seed}-{i}", rng.randint(0, 30)))
                for i in range(NUM_CLIENTS)
            ]
            await asyncio.gather(*(_hang_up(task, rng) for task in tasks))
            await asyncio.wait(tasks)
            await served.wait_until_idle()
        assert served.num_started() > NUM_CLIENTS * NUM_ROUNDS
