"""Bounded waits on a condition, the tests' one way to synchronise with what runs elsewhere."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_INTERVAL_S = 0.01


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``predicate`` until it holds; an AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s")
        await asyncio.sleep(POLL_INTERVAL_S)
