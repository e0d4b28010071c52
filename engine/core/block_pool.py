"""The pool of fixed-size KV blocks, by block id: reference counts, the free queue and the
prefix-cache map (held in ``block_pool_arrays``: C arrays where built, else Python's).

- Block 0 is the **null block** (``NULL_BLOCK``): never handed out nor freed, so a pool of
  ``num_blocks`` offers ``num_blocks - 1``; ``usage = 1 - num_free / (num_blocks - 1)``.
- The **free queue** runs front (evicted first) to back. A freed block keeps its hash and its KV:
  hashed blocks go to the back (least recently used evicted first), unhashed ones to the front
  (reused first, nothing worth keeping in them).
- A **cached** block (its hash in the map) stays findable while free; taking a free block for
  new data **evicts** its hash. A hit **touches** the block: a free one leaves the queue, and
  every touch adds a reference, so a block in use is never evicted.
- Callers free a request's blocks **tail first** (``KVCacheManager.free``), so the head of a
  prompt, the part most likely shared, stays cached the longest.

- **KV events** (for prefix-aware routers): with a ``kv_events.KVEventLog`` attached
  (``kv_events``; None by default, costing nothing), every hash entering the map is logged as
  stored (with its chain parent), every hash leaving it as removed, and a reset as cleared, so
  replaying the log gives exactly the map's keys.

Seam: an offload connector would be told of evictions (``on_evict``) to keep the block in a
lower tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shoal.engine.core.block_hash import BlockHash
from shoal.engine.core.block_pool_arrays import make_block_arrays
from shoal.engine.core.kv_events import KVEventLog

NULL_BLOCK = 0


class BlockPool:
    """Hands out block ids, takes them back and keeps the hash → block map of cached blocks.
    ``native``: the C arrays (None: where built; True: required; False: Python's)."""

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, native: bool | None = None
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.arrays = make_block_arrays(num_blocks, native)
        self.kv_events: KVEventLog | None = None  # attached by whoever publishes KV events

    @property
    def num_free_blocks(self) -> int:
        return self.arrays.num_free

    @property
    def num_cached_hashes(self) -> int:
        """Hashes in the prefix-cache map."""
        return self.arrays.num_cached

    @property
    def usage(self) -> float:
        return 1.0 - self.arrays.num_free / (self.num_blocks - 1)

    def get_new_blocks(self, count: int) -> list[int]:
        """Take ``count`` blocks from the front of the free queue, in ascending id order (a
        request's consecutive positions in consecutive rows where they can be, so a worker copies
        a run of them to or from an offload tier in one pass), evicting their old hashes."""
        if self.kv_events is None:
            return self.arrays.take(count, None)
        removed: list[bytes] = []
        block_ids = self.arrays.take(count, removed)
        for block_hash in removed:
            self.kv_events.removed(block_hash)
        return block_ids

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        block_id = self.arrays.lookup(block_hash)
        return None if block_id < 0 else block_id

    def get_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest run of ``block_hashes``, from the first."""
        return self.arrays.lookup_prefix(block_hashes)

    def cache_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Mark each full block as holding the tokens its hash names, in order (for a hash
        already cached, the first block keeps it). ``parent_hash``: the hash of the block
        before the first, ``lora_name`` the adapter that made them (for KV events)."""
        if self.kv_events is None:
            self.arrays.cache(block_ids, block_hashes, None)
            return
        added: list[bool] = []
        self.arrays.cache(block_ids, block_hashes, added)
        # Runs of hashes new to the map, each logged with the hash before it as its parent.
        run: list[BlockHash] = []
        run_parent = previous = parent_hash
        for block_hash, new in zip(block_hashes, added, strict=True):
            if new:
                if not run:
                    run_parent = previous
                run.append(block_hash)
            elif run:
                self.kv_events.stored(run, run_parent, lora_name)
                run = []
            previous = block_hash
        self.kv_events.stored(run, run_parent, lora_name)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on prefix-cache hits; free ones leave the free queue."""
        self.arrays.touch(block_ids)

    def free_blocks(self, block_ids: Iterable[int], drop_cached: bool = False) -> None:
        """Drop one reference each, in the given order; blocks reaching zero become free.

        ``drop_cached`` forgets the hashes of blocks that become free (their KV is not trusted,
        e.g. after a failed step).
        """
        if self.kv_events is None or not drop_cached:
            self.arrays.free(block_ids, drop_cached, None)
            return
        removed: list[bytes] = []
        self.arrays.free(block_ids, drop_cached, removed)
        for block_hash in removed:
            self.kv_events.removed(block_hash)

    def ref_cnt(self, block_id: int) -> int:
        return self.arrays.ref_cnt(block_id)

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash of the tokens the block holds, or None."""
        return self.arrays.block_hash(block_id)

    def num_unreferenced(self, block_ids: Iterable[int]) -> int:
        """How many of the blocks no request holds (hits that would leave the free queue)."""
        return self.arrays.count_free(block_ids)

    def free_block_ids(self) -> list[int]:
        """The free queue, front (taken first) to back."""
        return self.arrays.free_ids()

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the map."""
        return self.arrays.cached_keys()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.arrays.num_free != self.num_blocks - 1:
            return False
        self.arrays.clear_hashes()
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True
