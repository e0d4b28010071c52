"""A KV block and the free queue threaded through the blocks themselves.

The free queue is a doubly linked list whose links (``prev_free``/``next_free``) live on the
blocks, between two sentinels, as vLLM's ``FreeKVCacheBlockQueue``: taking from the front, putting
back at either end and removing from anywhere are O(1) on every call. A dict-backed queue
(``OrderedDict``) is O(1) only amortized: its table is rebuilt, O(number of blocks), every few
thousand insertions, which put a 1-2 ms stall into the step that happened to free the blocks
(``bench/scheduler.py``'s p99).

A block is in the queue exactly when ``prev_free`` is set; the sentinels never leave it.
"""

from __future__ import annotations

from collections.abc import Iterator
from operator import attrgetter
from typing import Any

from shoal.engine.core.block_hash import BlockHash


class KVCacheBlock:
    """One block: its id (row in the workers' KV tensors), references and prefix-cache hash."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        hashed = self.block_hash is not None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hashed={hashed})"


block_id_of = attrgetter("block_id")  # a block's id, as a key or in map() (no Python frame)


class FreeBlockQueue:
    """Free blocks in eviction order, front (evicted first) to back."""

    __slots__ = ("_head", "_len", "_tail")

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        self.extend(blocks)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        tail = self._tail
        while block is not tail and block is not None:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        """The free blocks' ids, front to back."""
        return [block.block_id for block in self]

    def popleft_n(self, count: int) -> list[KVCacheBlock]:
        """Take ``count`` blocks from the front (the caller checked there are that many)."""
        head = self._head
        taken: list[KVCacheBlock] = []
        block: Any = head.next_free  # typed loosely: no None check per block on this hot loop
        for _ in range(count):
            taken.append(block)
            following = block.next_free
            block.prev_free = block.next_free = None
            block = following
        head.next_free = block
        block.prev_free = head
        self._len -= count
        return taken

    def extend(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the back in order (the last one evicted last)."""
        tail = self._tail
        last = tail.prev_free
        assert last is not None
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = tail
        tail.prev_free = last
        self._len += len(blocks)

    def extendleft(self, blocks: list[KVCacheBlock]) -> None:
        """Put each block at the front in turn (the last one is taken first)."""
        head = self._head
        first = head.next_free
        assert first is not None
        for block in blocks:
            first.prev_free = block
            block.next_free = first
            first = block
        head.next_free = first
        first.prev_free = head
        self._len += len(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        """Take a block out from anywhere in the queue."""
        before, after = block.prev_free, block.next_free
        assert before is not None and after is not None, "the block is not free"
        before.next_free = after
        after.prev_free = before
        block.prev_free = block.next_free = None
        self._len -= 1
