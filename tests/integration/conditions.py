"""Waiting on a condition with a bound (never a bare sleep), and what the engine core must have
seen of an aborted request: the checks the abort and stop-string tests share."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from shoal.bus.messages.engine import SchedulerStats
from shoal.engine.core.engine_core import EngineCore

CONTEXT_LEN = 1024  # the tiny checkpoints' max_position_embeddings


async def wait_for(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` until it is true; AssertionError after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s} s")
        await asyncio.sleep(0.01)


async def wait_http_ready(url: str, timeout_s: float) -> None:
    """Until the gateway at ``url`` answers ``/health`` with 200; AssertionError after
    ``timeout_s``."""
    import aiohttp

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            try:
                async with session.get(f"{url}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError(f"{url} not serving within {timeout_s} s")


async def read_then_hang_up(stream: AsyncGenerator[object, None], num_outputs: int = 3) -> None:
    """Take ``num_outputs`` outputs of a running generation, then drop it (its consumer goes
    away: the engine client aborts it)."""
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == num_outputs:
            break
    await stream.aclose()


def core_is_settled(core: EngineCore) -> bool:
    """No request left in the engine core and no step in flight: with async scheduling the
    blocks of a request that ended wait for the step that may still write them."""
    return not core.scheduler.requests and not core.outstanding


def assert_ended_by_abort(
    stats: SchedulerStats, *, num_blocks: int, max_tokens: int, num_aborted: int = 1
) -> None:
    """The engine core finished ``num_aborted`` requests as aborted and none by itself, generated
    fewer tokens than asked for, runs nothing and has every KV block back in its free pool."""
    finished = (stats.num_finished_stop, stats.num_finished_length, stats.num_finished_error)
    assert (stats.num_finished_abort, finished) == (num_aborted, (0, 0, 0)), stats
    assert stats.num_generation_tokens < max_tokens, stats
    assert (stats.num_running, stats.num_waiting) == (0, 0), stats
    assert stats.num_free_blocks == num_blocks - 1, stats  # all but the null block


def pick_stop_string(text: str, min_start: int = 4) -> str:
    """Three ASCII letters or digits that really occur in ``text`` (a greedy run's output),
    found after its first ``min_start`` characters so the cut output is not empty."""
    for start in range(min_start, len(text) - 2):
        piece = text[start : start + 3]
        if piece.isascii() and piece.isalnum():
            return piece
    raise AssertionError(f"no ASCII stop string in {text!r}")
