"""Block pool: null block, free queue order, eviction, touch, usage, reset; on the C arrays
(where built) and on the Python ones alike."""

from __future__ import annotations

import pytest

from shoal.engine.core.block_pool import NULL_BLOCK, BlockPool
from shoal.engine.core.block_pool_arrays import native_block_arrays_available

pytestmark = pytest.mark.parametrize(
    "native",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not native_block_arrays_available(), reason="the C arrays are not built here"
            ),
        ),
    ],
    ids=["python", "native"],
)


def test_block_zero_is_the_null_block_and_never_handed_out(native: bool) -> None:
    pool = BlockPool(5, native=native)
    assert NULL_BLOCK == 0
    assert pool.num_free_blocks == 4
    assert pool.get_new_blocks(4) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1, native=native)


def test_usage_counts_usable_blocks_only(native: bool) -> None:
    pool = BlockPool(11, native=native)
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(5)
    assert pool.usage == pytest.approx(0.5)
    pool.free_blocks(blocks)
    assert pool.usage == 0.0


def test_freed_hashed_blocks_go_back_lru_and_unhashed_go_first(native: bool) -> None:
    pool = BlockPool(7, native=native)
    blocks = pool.get_new_blocks(6)  # 1..6
    pool.cache_blocks(blocks[:3], [bytes([block]) for block in blocks[:3]])
    # Free tail first, as the KV cache manager does: 6,5,4 unhashed, 3,2,1 hashed.
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [4, 5, 6, 3, 2, 1]
    # New blocks come from the front: unhashed first, then the least recently freed cached
    # (4, 5, 6, 3), handed out in id order.
    assert pool.get_new_blocks(4) == [3, 4, 5, 6]
    assert pool.get_cached_block(bytes([3])) is None  # evicted on reuse
    assert pool.get_cached_block(bytes([1])) == 1  # still cached while free
    assert pool.num_cached_hashes == 2


def test_cache_blocks_caches_each_pair_in_order_and_the_first_of_a_hash_wins(
    native: bool,
) -> None:
    pool = BlockPool(5, native=native)
    first, second, third = pool.get_new_blocks(3)
    pool.cache_blocks([first, second, third], [b"a", b"b", b"a"])
    assert [pool.block_hash(block) for block in (first, second, third)] == [b"a", b"b", b"a"]
    assert pool.get_cached_block(b"a") == first and pool.get_cached_block(b"b") == second
    assert pool.get_cached_prefix([b"a", b"b", b"c", b"a"]) == [first, second]


def test_touch_takes_a_reference_and_protects_from_eviction(native: bool) -> None:
    pool = BlockPool(4, native=native)
    blocks = pool.get_new_blocks(3)
    pool.cache_blocks([blocks[0]], [b"h"])
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 3 and pool.num_unreferenced(blocks) == 3
    hit = pool.get_cached_block(b"h")
    assert hit == blocks[0]
    pool.touch([hit])
    assert pool.ref_cnt(hit) == 1 and hit not in pool.free_block_ids()
    assert pool.num_unreferenced(blocks) == 2
    assert blocks[0] not in pool.get_new_blocks(2)
    pool.touch([hit])
    assert pool.ref_cnt(hit) == 2
    pool.free_blocks([hit])
    assert pool.ref_cnt(hit) == 1 and hit not in pool.free_block_ids()


def test_first_cached_block_wins_and_duplicate_eviction_keeps_it(native: bool) -> None:
    pool = BlockPool(4, native=native)
    first, second = pool.get_new_blocks(2)
    pool.cache_blocks([first], [b"h"])
    pool.cache_blocks([second], [b"h"])
    assert pool.get_cached_block(b"h") == first
    pool.free_blocks([second])
    pool.get_new_blocks(2)  # takes block 3 then the freed duplicate
    assert pool.get_cached_block(b"h") == first


def test_drop_cached_forgets_hashes_of_freed_blocks(native: bool) -> None:
    pool = BlockPool(3, native=native)
    block = pool.get_new_blocks(1)[0]
    pool.cache_blocks([block], [b"h"])
    pool.free_blocks([block], drop_cached=True)
    assert pool.get_cached_block(b"h") is None and pool.block_hash(block) is None
    assert pool.free_block_ids()[0] == block  # unhashed now: taken first


def test_reset_prefix_cache_only_when_everything_is_free(native: bool) -> None:
    pool = BlockPool(4, native=native)
    block = pool.get_new_blocks(1)[0]
    pool.cache_blocks([block], [b"h"])
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h") is None and pool.block_hash(block) is None
    assert pool.cached_hashes() == [] and pool.num_cached_hashes == 0


def test_bad_calls_are_refused_and_change_nothing(native: bool) -> None:
    pool = BlockPool(4, native=native)
    block = pool.get_new_blocks(1)[0]
    with pytest.raises(ValueError, match="no reference"):
        pool.free_blocks([2])  # never taken
    with pytest.raises(IndexError, match="out of range"):
        pool.touch([9])
    with pytest.raises(ValueError, match="1 to 32 bytes"):
        pool.cache_blocks([block], [b"x" * 33])
    with pytest.raises(TypeError, match="must be bytes"):
        pool.get_cached_block("h")  # type: ignore[arg-type]
    assert pool.num_free_blocks == 2 and pool.ref_cnt(block) == 1
    # A refused free keeps what it did before the bad id: the first block is free and queued.
    with pytest.raises(ValueError, match="no reference"):
        pool.free_blocks([block, 2])
    assert pool.ref_cnt(block) == 0 and pool.free_block_ids() == [block, 2, 3]
    assert pool.get_new_blocks(3) == [1, 2, 3]
