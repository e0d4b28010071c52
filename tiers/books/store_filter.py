"""``store_threshold``: store a chunk only once it has been offered N times.

A chunk seen once is often never seen again (a one-off prompt); counting offers keeps such chunks
from pushing reusable ones out. The counts live in a bounded, least-recently-offered-first table,
so a flood of one-off keys forgets the oldest counts instead of growing without limit. A threshold
below 2 stores everything.
"""

from __future__ import annotations

from collections import OrderedDict

from shoal.tiers.books.keys import OffloadKey

DEFAULT_MAX_TRACKER_SIZE = 64_000


class StoreFilter:
    def __init__(self, threshold: int = 0, max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE):
        if threshold < 0:
            raise ValueError(f"store_threshold must be >= 0, got {threshold}")
        if max_tracker_size < 1:
            raise ValueError(f"max_tracker_size must be >= 1, got {max_tracker_size}")
        self.threshold = threshold
        self.max_tracker_size = max_tracker_size
        self._offers: OrderedDict[OffloadKey, int] = OrderedDict()

    @property
    def is_enabled(self) -> bool:
        return self.threshold >= 2

    def offer(self, key: OffloadKey) -> bool:
        """Count one offer of a key that is not stored; true once it has been offered N times."""
        if not self.is_enabled:
            return True
        count = self._offers.pop(key, 0) + 1
        self._offers[key] = count  # the most recently offered end
        if len(self._offers) > self.max_tracker_size:
            self._offers.popitem(last=False)
        return count >= self.threshold

    def forget(self, key: OffloadKey) -> None:
        """The key was stored: a later offer (after its eviction) counts from zero."""
        self._offers.pop(key, None)

    def __len__(self) -> int:
        return len(self._offers)

    def clear(self) -> None:
        self._offers.clear()
