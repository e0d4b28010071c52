"""Lookups waiting for promotions in flight (the CPU tier's shell, ``tiers.cpu.actor``).

A lookup whose prefix goes on with chunks another lookup is promoting from a secondary waits for
that promotion instead of promoting them again; which promotion brings a key is in the books
(``CpuTierBooks``, pure), the waiting is here: one ``asyncio.Event`` per promotion in flight,
opened when its slots are reserved and closed, after the books record its end, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib


class PromotionWaits:
    """An ``asyncio.Event`` per promotion in flight, set and dropped when it ends (finished,
    failed, timed out or cancelled): lookups wait on it for at most their own budget."""

    def __init__(self) -> None:
        self._events: dict[int, asyncio.Event] = {}

    def __len__(self) -> int:
        return len(self._events)

    def open(self, promotion_id: int) -> None:
        self._events[promotion_id] = asyncio.Event()

    def close(self, promotion_id: int) -> None:
        event = self._events.pop(promotion_id, None)
        if event is not None:
            event.set()

    async def wait(self, promotion_id: int, timeout_s: float) -> None:
        """Until the promotion ends or ``timeout_s`` passes (at once if it is not in flight)."""
        event = self._events.get(promotion_id)
        if event is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
