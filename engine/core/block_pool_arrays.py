"""The block pool's state by block id: the free queue, reference counts, each block's hash and
the prefix-cache map, behind one small interface with two implementations.

- ``NativeBlockArrays`` (``native_block_pool.c``, built by ``setup.py`` where a C compiler is
  found): flat arrays, the map an open-addressed table of block ids (~1.5 MB for 20,000 blocks).
  A wave of ~500 blocks taken, cached and freed cost ~350 + 220 + 140 ns a block as Python
  objects (a block object, a dict entry and a bytes key each, scattered: cache misses), which
  set the scheduler's tail (``bench/scheduler.py``).
- ``BlockArrays`` (here): the same in Python lists and a dict, where the extension is not built
  (or ``$SHOAL_BLOCK_ARRAYS=python``); the reference the native one is tested against.

The free queue is a doubly linked list of ids between two sentinels (``num_blocks`` and
``num_blocks + 1``): taking from the front, putting back at either end and removing from anywhere
are O(1) on every call (a dict-backed queue is O(1) only amortized: its table rebuilds put 1-2 ms
into one step). A block is queued exactly when its ``prev`` link is set. Block 0 is the null
block: never queued, never handed out.

Methods (ids are ints; ``removed``/``added`` are lists to report into, or None):

- ``take(count, removed)``: ``count`` blocks from the front in ascending id order, one reference
  each, their hashes forgotten (appended to ``removed`` where the map named that block).
- ``lookup(key)`` / ``lookup_prefix(keys)``: the block the map names (-1 if none) / the blocks of
  the longest run of keys, from the first, the map holds.
- ``cache(ids, keys, added)``: each block holds its key's tokens; the map takes keys it lacks
  (the first block keeps a key); ``added`` gets one bool a key.
- ``touch(ids)``: a reference more each; free blocks leave the queue.
- ``free(ids, drop_cached, removed)``: a reference less each, in order; blocks reaching zero go
  to the front when unhashed (the last taken first), to the back when hashed; ``drop_cached``
  forgets their hashes first.
- ``ref_cnt(id)``, ``block_hash(id)``, ``count_free(ids)``, ``free_ids()`` (front to back),
  ``cached_keys()``, ``clear_hashes()``, ``num_free``, ``num_cached``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Protocol

MAX_KEY_BYTES = 32  # sha256; xxh3-128 is 16
BLOCK_ARRAYS_ENV = "SHOAL_BLOCK_ARRAYS"  # native, python or auto (make_block_arrays)
_NO_LINK = -1


class BlockArraysLike(Protocol):
    """What the block pool asks of its arrays (both implementations)."""

    @property
    def num_free(self) -> int: ...
    @property
    def num_cached(self) -> int: ...
    def take(self, count: int, removed: list[bytes] | None) -> list[int]: ...
    def lookup(self, key: bytes) -> int: ...
    def lookup_prefix(self, keys: Sequence[bytes]) -> list[int]: ...
    def cache(
        self, ids: Sequence[int], keys: Sequence[bytes], added: list[bool] | None
    ) -> None: ...
    def touch(self, ids: Iterable[int]) -> None: ...
    def free(self, ids: Iterable[int], drop_cached: bool, removed: list[bytes] | None) -> None: ...
    def ref_cnt(self, block_id: int) -> int: ...
    def block_hash(self, block_id: int) -> bytes | None: ...
    def count_free(self, ids: Iterable[int]) -> int: ...
    def free_ids(self) -> list[int]: ...
    def cached_keys(self) -> list[bytes]: ...
    def clear_hashes(self) -> None: ...


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"a block hash must be bytes, not {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a block hash must be 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")


class BlockArrays:
    """The pure-Python implementation (see the module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        if not 2 <= num_blocks <= 1 << 30:
            raise ValueError(f"num_blocks must be 2 to 2**30, got {num_blocks}")
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.prev = [_NO_LINK] * (num_blocks + 2)
        self.next = [_NO_LINK] * (num_blocks + 2)
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.map: dict[bytes, int] = {}
        self.head, self.tail = num_blocks, num_blocks + 1
        self.next[self.head], self.prev[self.tail] = self.tail, self.head
        self._num_free = 0
        for block_id in range(1, num_blocks):  # block 0: the null block
            self._push_back(block_id)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_cached(self) -> int:
        return len(self.map)

    # ----- the free queue

    def _unlink(self, block_id: int) -> None:
        before, after = self.prev[block_id], self.next[block_id]
        self.next[before], self.prev[after] = after, before
        self.prev[block_id] = self.next[block_id] = _NO_LINK
        self._num_free -= 1

    def _push_back(self, block_id: int) -> None:
        last = self.prev[self.tail]
        self.next[last], self.prev[block_id] = block_id, last
        self.next[block_id], self.prev[self.tail] = self.tail, block_id
        self._num_free += 1

    # ----- the map

    def _drop_hash(self, block_id: int, removed: list[bytes] | None) -> None:
        key = self.hashes[block_id]
        if key is None:
            return
        if self.map.get(key) == block_id:
            del self.map[key]
            if removed is not None:
                removed.append(key)
        self.hashes[block_id] = None

    # ----- the interface

    def take(self, count: int, removed: list[bytes] | None) -> list[int]:
        if not 0 <= count <= self._num_free:
            raise ValueError(f"cannot take {count} blocks, only {self._num_free} free")
        # The hot loops are written out (no helper calls): a wave takes, caches and frees
        # hundreds of blocks.
        prev, next_, refs, head = self.prev, self.next, self.refs, self.head
        ids = []
        block_id = next_[head]
        for _ in range(count):
            ids.append(block_id)
            following = next_[block_id]
            prev[block_id] = next_[block_id] = _NO_LINK
            refs[block_id] = 1
            block_id = following
        next_[head], prev[block_id] = block_id, head
        self._num_free -= count
        ids.sort()  # ascending: consecutive rows where they can be (see native_block_pool.c)
        hashes, cached = self.hashes, self.map
        for block_id in ids:
            key = hashes[block_id]
            if key is not None:
                if cached.get(key) == block_id:
                    del cached[key]
                    if removed is not None:
                        removed.append(key)
                hashes[block_id] = None
        return ids

    def lookup(self, key: bytes) -> int:
        _check_key(key)
        return self.map.get(key, -1)

    def lookup_prefix(self, keys: Sequence[bytes]) -> list[int]:
        hits = []
        get = self.map.get
        for key in keys:
            block_id = get(key)
            if block_id is None:
                _check_key(key)
                break
            hits.append(block_id)
        return hits

    def cache(self, ids: Sequence[int], keys: Sequence[bytes], added: list[bool] | None) -> None:
        if len(ids) != len(keys):
            raise ValueError("cache: as many keys as blocks")
        self._check_ids(ids)
        if not all(keys) or max(map(len, keys), default=1) > MAX_KEY_BYTES:
            for key in keys:
                _check_key(key)
        hashes, cached = self.hashes, self.map
        for block_id, key in zip(ids, keys, strict=True):
            held = hashes[block_id]
            if held is None:  # the common case: a block just filled
                hashes[block_id] = key
                taken = cached.setdefault(key, block_id) == block_id
            elif held != key:
                self._drop_hash(block_id, None)
                hashes[block_id] = key
                taken = cached.setdefault(key, block_id) == block_id
            else:  # held already: taken only where the map lost it (its other block evicted)
                taken = key not in cached
                if taken:
                    cached[key] = block_id
            if added is not None:
                added.append(taken)

    def touch(self, ids: Iterable[int]) -> None:
        refs, prev = self.refs, self.prev
        for block_id in ids:
            self._check_id(block_id)
            if refs[block_id] == 0 and prev[block_id] != _NO_LINK:
                self._unlink(block_id)
            refs[block_id] += 1

    def free(self, ids: Iterable[int], drop_cached: bool, removed: list[bytes] | None) -> None:
        ids = list(ids)
        self._check_ids(ids)
        refs = self.refs
        freed: list[int] = []
        try:
            for block_id in ids:
                count = refs[block_id]
                if count <= 0:
                    raise ValueError(f"block {block_id} freed with no reference held")
                refs[block_id] = count - 1
                if count == 1:
                    freed.append(block_id)
                    if drop_cached:
                        self._drop_hash(block_id, removed)
        finally:  # (also after an error: the blocks that reached zero are queued)
            self._queue_freed(freed)

    def _queue_freed(self, freed: list[int]) -> None:
        hashes = self.hashes
        to_front = [block_id for block_id in freed if hashes[block_id] is None]
        to_back = [block_id for block_id in freed if hashes[block_id] is not None]
        prev, next_ = self.prev, self.next
        if to_front:  # each at the front in turn: the last one is taken first
            head = self.head
            first = next_[head]
            for block_id in to_front:
                prev[first], next_[block_id] = block_id, first
                first = block_id
            next_[head], prev[first] = first, head
        if to_back:  # at the back in order: the last one evicted last
            tail = self.tail
            last = prev[tail]
            for block_id in to_back:
                next_[last], prev[block_id] = block_id, last
                last = block_id
            prev[tail], next_[last] = last, tail
        self._num_free += len(to_front) + len(to_back)

    def ref_cnt(self, block_id: int) -> int:
        self._check_id(block_id)
        return self.refs[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        self._check_id(block_id)
        return self.hashes[block_id]

    def count_free(self, ids: Iterable[int]) -> int:
        return sum(1 for block_id in ids if self.ref_cnt(block_id) == 0)

    def free_ids(self) -> list[int]:
        ids, block_id = [], self.next[self.head]
        while block_id != self.tail:
            ids.append(block_id)
            block_id = self.next[block_id]
        return ids

    def cached_keys(self) -> list[bytes]:
        return list(self.map)

    def clear_hashes(self) -> None:
        self.hashes = [None] * self.num_blocks
        self.map.clear()

    def _check_ids(self, ids: Sequence[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            for block_id in ids:
                self._check_id(block_id)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")


def native_block_arrays_available() -> bool:
    """Whether ``setup.py`` built the C implementation here."""
    try:
        from shoal.engine.core import _native_block_pool  # noqa: F401
    except ImportError:
        return False
    return True


def make_block_arrays(num_blocks: int, native: bool | None = None) -> BlockArraysLike:
    """The C arrays where built, else Python's. ``native``: True requires the C ones, False
    takes Python's, None (the default) asks ``$SHOAL_BLOCK_ARRAYS`` (``native``, ``python``;
    unset or ``auto``: the C ones where built)."""
    if native is None:
        choice = os.environ.get(BLOCK_ARRAYS_ENV, "auto")
        if choice not in ("auto", "native", "python"):
            raise ValueError(f"{BLOCK_ARRAYS_ENV} must be auto, native or python, got {choice!r}")
        native = {"auto": None, "native": True, "python": False}[choice]
    if native is False or (native is None and not native_block_arrays_available()):
        return BlockArrays(num_blocks)
    from shoal.engine.core._native_block_pool import NativeBlockArrays

    arrays: BlockArraysLike = NativeBlockArrays(num_blocks)
    return arrays
