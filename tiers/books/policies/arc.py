"""ARC (adaptive replacement cache) over an offload tier's chunks.

``T1`` holds chunks seen once, ``T2`` chunks reused since they were stored; ``B1``/``B2`` are
ghost lists of keys recently evicted from ``T1``/``T2`` (keys only, no slot). ``target_t1_size``
is how large ``T1`` may grow before eviction takes from it:

* a store inserts into ``T1`` (most recent end) and drops the key from both ghost lists;
* reuse (``touch``) of a **ready** chunk moves it from ``T1`` to ``T2``, or to ``T2``'s recent end;
  a chunk still being written stays in ``T1`` (a write is not a frequency hit);
* a touched key found in ``B1`` grows the target by ``max(1, |B2| // |B1|)`` (up to capacity); one
  found in ``B2`` shrinks it by ``max(1, |B1| // |B2|)`` (down to 0); the key stays a ghost until
  it is stored again;
* eviction takes from ``T1`` while ``|T1| >= target``, else from ``T2``, and falls back to the
  other list when the chosen one has no idle, unprotected chunk; it is atomic (``n`` or none);
* each ghost list keeps at most ``capacity`` keys, the oldest dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence

from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.books.policies.base import Chunk, EvictionPolicy

KeyList = OrderedDict[OffloadKey, None]  # least recent first


class ARCPolicy(EvictionPolicy):
    def __init__(self, capacity: int, chunks: Mapping[OffloadKey, Chunk]) -> None:
        super().__init__(capacity, chunks)
        self.target_t1_size = 0
        self.t1: KeyList = OrderedDict()
        self.t2: KeyList = OrderedDict()
        self.b1: KeyList = OrderedDict()
        self.b2: KeyList = OrderedDict()

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t1[key] = None
            self.t1.move_to_end(key)

    def remove(self, key: OffloadKey) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            self._reuse(key)

    def on_request_finished(
        self, keys: Sequence[OffloadKey], inserted_keys: Collection[OffloadKey]
    ) -> None:
        for key in reversed(keys):
            if key in inserted_keys:
                self._refresh(key)
            else:
                self._reuse(key)

    def _refresh(self, key: OffloadKey) -> None:
        """Recency only: to the recent end of the list it is in."""
        for keys in (self.t1, self.t2):
            if key in keys:
                keys.move_to_end(key)

    def _reuse(self, key: OffloadKey) -> None:
        if key in self.t1:
            chunk = self.chunks.get(key)
            if chunk is not None and chunk.is_ready:
                del self.t1[key]
                self.t2[key] = None
            else:
                self.t1.move_to_end(key)
        elif key in self.t2:
            self.t2.move_to_end(key)
        elif key in self.b1:
            step = max(1, len(self.b2) // len(self.b1))
            self.target_t1_size = min(self.capacity, self.target_t1_size + step)
        elif key in self.b2:
            step = max(1, len(self.b1) // len(self.b2))
            self.target_t1_size = max(0, self.target_t1_size - step)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        t1_candidates = [k for k in self.t1 if self._is_candidate(k, protected)]
        t2_candidates = [k for k in self.t2 if self._is_candidate(k, protected)]
        if len(t1_candidates) + len(t2_candidates) < n:
            return None
        t1_size = len(self.t1)
        from_t1: list[OffloadKey] = []
        from_t2: list[OffloadKey] = []
        victims: list[OffloadKey] = []
        for _ in range(n):
            t1_left = len(from_t1) < len(t1_candidates)
            t2_left = len(from_t2) < len(t2_candidates)
            if t1_left and (t1_size >= self.target_t1_size or not t2_left):
                key = t1_candidates[len(from_t1)]
                from_t1.append(key)
                t1_size -= 1
            else:
                key = t2_candidates[len(from_t2)]
                from_t2.append(key)
            victims.append(key)
        self._to_ghosts(from_t1, self.t1, self.b1)
        self._to_ghosts(from_t2, self.t2, self.b2)
        return victims

    def _to_ghosts(self, keys: list[OffloadKey], source: KeyList, ghosts: KeyList) -> None:
        for key in keys:
            del source[key]
            ghosts[key] = None
            ghosts.move_to_end(key)
        while len(ghosts) > self.capacity:
            ghosts.popitem(last=False)

    def clear(self) -> None:
        self.target_t1_size = 0
        for keys in (self.t1, self.t2, self.b1, self.b2):
            keys.clear()
