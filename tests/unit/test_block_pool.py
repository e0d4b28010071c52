"""Block pool: null block, free queue order, eviction, touch, usage, reset."""

from __future__ import annotations

import pytest

from shoal.engine.core.block_pool import BlockPool


def ids(blocks: object) -> list[int]:
    return [block.block_id for block in blocks]  # type: ignore[attr-defined]


def test_block_zero_is_the_null_block_and_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0
    assert pool.num_free_blocks == 4
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


def test_usage_counts_usable_blocks_only() -> None:
    pool = BlockPool(11)
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(5)
    assert pool.usage == pytest.approx(0.5)
    pool.free_blocks(blocks)
    assert pool.usage == 0.0


def test_freed_hashed_blocks_go_back_lru_and_unhashed_go_first() -> None:
    pool = BlockPool(7)
    blocks = pool.get_new_blocks(6)  # 1..6
    pool.cache_blocks(blocks[:3], [bytes([block.block_id]) for block in blocks[:3]])
    # Free tail first, as the KV cache manager does: 6,5,4 unhashed, 3,2,1 hashed.
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue.block_ids() == [4, 5, 6, 3, 2, 1]
    # New blocks come from the front: unhashed first, then the least recently freed cached
    # (4, 5, 6, 3), handed out in id order.
    assert ids(pool.get_new_blocks(4)) == [3, 4, 5, 6]
    assert pool.get_cached_block(bytes([3])) is None  # evicted on reuse
    assert pool.get_cached_block(bytes([1])) is blocks[0]  # still cached while free


def test_cache_blocks_caches_each_pair_in_order_and_the_first_of_a_hash_wins() -> None:
    pool = BlockPool(5)
    first, second, third = pool.get_new_blocks(3)
    pool.cache_blocks([first, second, third], [b"a", b"b", b"a"])
    assert [block.block_hash for block in (first, second, third)] == [b"a", b"b", b"a"]
    assert pool.get_cached_block(b"a") is first and pool.get_cached_block(b"b") is second


def test_touch_takes_a_reference_and_protects_from_eviction() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_blocks([blocks[0]], [b"h"])
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 3
    hit = pool.get_cached_block(b"h")
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit not in pool.free_queue
    assert blocks[0] not in pool.get_new_blocks(2)
    pool.touch([hit])
    assert hit.ref_cnt == 2
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and hit not in pool.free_queue


def test_first_cached_block_wins_and_duplicate_eviction_keeps_it() -> None:
    pool = BlockPool(4)
    first, second = pool.get_new_blocks(2)
    pool.cache_blocks([first], [b"h"])
    pool.cache_blocks([second], [b"h"])
    assert pool.get_cached_block(b"h") is first
    pool.free_blocks([second])
    pool.get_new_blocks(2)  # takes block 3 then the freed duplicate
    assert pool.get_cached_block(b"h") is first


def test_drop_cached_forgets_hashes_of_freed_blocks() -> None:
    pool = BlockPool(3)
    block = pool.get_new_blocks(1)[0]
    pool.cache_blocks([block], [b"h"])
    pool.free_blocks([block], drop_cached=True)
    assert pool.get_cached_block(b"h") is None and block.block_hash is None


def test_reset_prefix_cache_only_when_everything_is_free() -> None:
    pool = BlockPool(4)
    block = pool.get_new_blocks(1)[0]
    pool.cache_blocks([block], [b"h"])
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h") is None and block.block_hash is None
