"""The pool of fixed-size KV blocks: reference counts, the free queue and the prefix-cache map.

- Block 0 is the **null block**: taken out at start, never handed out nor freed, so a pool of
  ``num_blocks`` offers ``num_blocks - 1``; ``usage = 1 - num_free / (num_blocks - 1)``.
- The **free queue** (``free_queue``, a ``FreeBlockQueue``) is a doubly linked list threaded
  through the blocks, front evicted first: O(1) append, prepend, pop and removal from anywhere on
  every call. A freed block keeps its hash and its KV: hashed blocks go to the back (least
  recently used evicted first), unhashed ones to the front (reused first, nothing worth keeping
  in them).
- A **cached** block (``block_hash`` set, in ``cached_blocks``) stays findable while free; taking a
  free block for new data **evicts** its hash. A hit **touches** the block: a free one leaves the
  queue, and every touch adds a reference, so a block in use is never evicted.
- Callers free a request's blocks **tail first** (``KVCacheManager.free``), so the head of a
  prompt, the part most likely shared, stays cached the longest.

- **KV events** (for prefix-aware routers): with a ``kv_events.KVEventLog`` attached
  (``kv_events``; None by default, costing nothing), every hash entering the map is logged as
  stored (with its chain parent), every hash leaving it as removed, and a reset as cleared, so
  replaying the log gives exactly the keys of ``cached_blocks``.

Seam: an offload connector would be told of evictions (``on_evict``) to keep the block in a
lower tier.
"""

from __future__ import annotations

from collections.abc import Iterable

from shoal.engine.core.block_hash import BlockHash
from shoal.engine.core.free_block_queue import FreeBlockQueue, KVCacheBlock, block_id_of
from shoal.engine.core.kv_events import KVEventLog


class BlockPool:
    """Hands out blocks, takes them back and keeps the hash → block map of cached blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.kv_events: KVEventLog | None = None  # attached by whoever publishes KV events

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / (self.num_blocks - 1)

    def get_new_blocks(self, count: int) -> list[KVCacheBlock]:
        """Take ``count`` blocks from the front of the free queue, evicting their old hashes."""
        if count > len(self.free_queue):
            raise ValueError(f"cannot take {count} blocks, only {len(self.free_queue)} free")
        cached = self.cached_blocks
        blocks = self.free_queue.popleft_n(count)
        # Ascending ids: a request's consecutive positions get consecutive rows where they can
        # (blocks freed tail first come back in descending order), so a worker copies a run of
        # them to or from an offload tier in one pass.
        blocks.sort(key=block_id_of)
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                if cached.get(block_hash) is block:
                    del cached[block_hash]
                    if self.kv_events is not None:
                        self.kv_events.removed(block_hash)
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_blocks(
        self,
        blocks: Iterable[KVCacheBlock],
        block_hashes: Iterable[BlockHash],
        parent_hash: BlockHash | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Mark each full block as holding the tokens its hash names, in order (for a hash
        already cached, the first block keeps it). ``parent_hash``: the hash of the block
        before the first, ``lora_name`` the adapter that made them (for KV events)."""
        setdefault = self.cached_blocks.setdefault
        if self.kv_events is None:
            for block, block_hash in zip(blocks, block_hashes, strict=True):
                block.block_hash = block_hash
                setdefault(block_hash, block)
            return
        # Runs of hashes new to the map, each logged with the hash before it as its parent.
        run: list[BlockHash] = []
        run_parent = previous = parent_hash
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            block.block_hash = block_hash
            if setdefault(block_hash, block) is block:
                if not run:
                    run_parent = previous
                run.append(block_hash)
            elif run:
                self.kv_events.stored(run, run_parent, lora_name)
                run = []
            previous = block_hash
        self.kv_events.stored(run, run_parent, lora_name)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; free ones leave the free queue."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock], drop_cached: bool = False) -> None:
        """Drop one reference each, in the given order; blocks reaching zero become free.

        ``drop_cached`` forgets the hashes of blocks that become free (their KV is not trusted,
        e.g. after a failed step).
        """
        to_front: list[KVCacheBlock] = []  # nothing worth keeping in them: taken first
        to_back: list[KVCacheBlock] = []  # cached: evicted last, least recently freed first
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            if drop_cached and block.block_hash is not None:
                self._evict_hash(block)
            (to_front if block.block_hash is None else to_back).append(block)
        if to_front:
            self.free_queue.extendleft(to_front)
        if to_back:
            self.free_queue.extend(to_back)

    def _evict_hash(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is not None and self.cached_blocks.get(block_hash) is block:
            del self.cached_blocks[block_hash]
            if self.kv_events is not None:
                self.kv_events.removed(block_hash)
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if len(self.free_queue) != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True
