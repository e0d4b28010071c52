"""The eviction policy seam of an offload tier's manager, and the chunk state it reads.

The manager owns the chunk table (key → ``Chunk``) and the slots; a policy owns only the order in
which idle chunks leave. It reads the table it was given (never writes it) to tell idle chunks
(``ref_cnt == 0``) from pinned ones (``ref_cnt > 0``, being loaded) and from chunks still being
written (``ref_cnt == NOT_READY``). ``evict`` is atomic: ``n`` victims, or ``None`` and no change.

Key lists passed to a policy are in a request's prefix order (head first). One call is one
request's access: the whole list becomes more recent than everything before it, and within it the
tail is older than the head, so a request's tail leaves before its head (a prefix is only useful
as a contiguous run from its first chunk).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from shoal.tiers.books.keys import OffloadKey

NOT_READY = -1


@dataclass(slots=True)
class Chunk:
    """One stored chunk: its slot in the tier and its reference count.

    ``ref_cnt`` is ``NOT_READY`` while the chunk is being written, then the number of loads that
    have it pinned (0: idle, evictable).
    """

    slot_id: int
    ref_cnt: int = NOT_READY

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0

    @property
    def is_evictable(self) -> bool:
        return self.ref_cnt == 0


class EvictionPolicy(ABC):
    """Orders a tier's chunks for eviction; registered by name in ``shoal.tiers.books.policies``."""

    def __init__(self, capacity: int, chunks: Mapping[OffloadKey, Chunk]) -> None:
        self.capacity = capacity
        self.chunks = chunks

    @abstractmethod
    def insert(self, keys: Sequence[OffloadKey]) -> None:
        """New chunks (already in the table, not ready yet), in prefix order."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Forget a chunk that never became ready (a failed store): no history is kept."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """A request reused these keys (prefix order); keys not held may still teach it."""

    def on_request_finished(
        self, keys: Sequence[OffloadKey], inserted_keys: Collection[OffloadKey]
    ) -> None:
        """Commit a finished request's access in prefix order. ``inserted_keys`` are chunks the
        request only stored (no reuse): recency, never frequency. The default is a touch."""
        del inserted_keys
        self.touch(keys)

    @abstractmethod
    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        """``n`` idle, unprotected victims, now forgotten; or ``None``, changing nothing."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything (the manager cleared its table)."""

    def _is_candidate(self, key: OffloadKey, protected: Collection[OffloadKey]) -> bool:
        chunk = self.chunks.get(key)
        return chunk is not None and chunk.is_evictable and key not in protected
