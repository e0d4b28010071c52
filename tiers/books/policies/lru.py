"""LRU: one recency order; a request's access moves its keys to the recent end, tail first.

A request's keys share one recency "rank" and, within it, its tail is evicted before its head.
Recency changes only when the manager says a request touched or finished, never when a transfer
completes, so the order does not depend on which write finished first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence

from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.books.policies.base import Chunk, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    def __init__(self, capacity: int, chunks: Mapping[OffloadKey, Chunk]) -> None:
        super().__init__(capacity, chunks)
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()  # least recent first

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            self._order[key] = None
            self._order.move_to_end(key)

    def remove(self, key: OffloadKey) -> None:
        self._order.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            if key in self._order:
                self._order.move_to_end(key)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        victims = []
        for key in self._order:
            if self._is_candidate(key, protected):
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def clear(self) -> None:
        self._order.clear()

    def order(self) -> list[OffloadKey]:
        """Least recent first (for tests and debugging)."""
        return list(self._order)
