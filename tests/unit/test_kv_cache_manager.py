"""KV cache manager: allocation, prefix hits, tail-first freeing, counters."""

from __future__ import annotations

from shoal.engine.core.block_hash import BlockHasher
from shoal.engine.core.kv_cache_manager import KVCacheManager
from shoal.engine.core.request import Request
from tests.unit.factories import make_request

BLOCK = 4


def hashed(request_id: str, prompt: list[int], **kwargs: object) -> Request:
    request = make_request(request_id, prompt, **kwargs)  # type: ignore[arg-type]
    request.set_block_hasher(BlockHasher(BLOCK))
    return request


def admit(manager: KVCacheManager, request: Request) -> list[int]:
    """Take hits and allocate the rest of the prompt, as the scheduler's waiting loop does."""
    hits, num_hit = manager.get_computed_blocks(request)
    new_ids = manager.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new_ids is not None
    request.num_computed_tokens = request.num_tokens
    return new_ids


def test_allocate_covers_the_tokens_and_only_grows_on_a_block_boundary() -> None:
    manager = KVCacheManager(10, BLOCK)
    request = hashed("r", list(range(10)))
    assert admit(manager, request) == [1, 2, 3]
    request.append_output_token_id(99)
    request.append_output_token_id(98)  # 12 tokens, 10 computed: still inside block 3
    assert manager.allocate_slots(request, 2) == []
    request.num_computed_tokens = 12
    request.append_output_token_id(97)
    assert manager.allocate_slots(request, 1) == [4]
    assert manager.get_block_ids("r") == [1, 2, 3, 4]


def test_full_blocks_are_cached_at_allocation() -> None:
    manager = KVCacheManager(10, BLOCK)
    request = hashed("r", list(range(10)))
    admit(manager, request)
    pool = manager.block_pool
    assert [pool.get_cached_block(h) for h in request.block_hashes] == [1, 2]
    assert pool.num_cached_hashes == 2  # the partial third block is not cached


def test_identical_prompt_hits_all_but_the_last_token() -> None:
    manager = KVCacheManager(20, BLOCK)
    admit(manager, hashed("a", list(range(12))))
    hits, num_hit = manager.get_computed_blocks(hashed("b", list(range(12))))
    # 12 tokens = 3 full blocks, but the last token must be computed: 2 blocks hit.
    assert hits == [1, 2] and num_hit == 8
    hits, num_hit = manager.get_computed_blocks(hashed("c", list(range(13))))
    assert hits == [1, 2, 3] and num_hit == 12


def test_hit_takes_a_reference_and_shared_blocks_are_not_evicted() -> None:
    manager = KVCacheManager(6, BLOCK)  # 5 usable blocks
    first = hashed("a", [*list(range(8)), 50])
    admit(manager, first)  # blocks 1, 2, 3
    second = hashed("b", [*list(range(8)), 60])
    assert admit(manager, second) == [4]
    assert manager.get_block_ids("b") == [1, 2, 4]
    assert [manager.block_pool.ref_cnt(i) for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    manager.free(first)
    assert manager.block_pool.ref_cnt(1) == 1
    assert manager.num_free_blocks == 2
    other = hashed("c", list(range(100, 108)))
    # The freed partial block 3 (unhashed) is reused first; never 1 or 2, which "b" still uses.
    assert admit(manager, other) == [3, 5]
    assert manager.block_pool.block_hash(1) == second.block_hashes[0]


def test_free_is_tail_first_so_the_head_is_evicted_last() -> None:
    manager = KVCacheManager(10, BLOCK)
    request = hashed("r", list(range(14)))
    admit(manager, request)  # blocks 1..4, block 4 partial (unhashed)
    manager.free(request)
    free_order = manager.block_pool.free_block_ids()
    # Unhashed partial block first, then never-used blocks, then cached blocks tail first.
    assert free_order == [4, 5, 6, 7, 8, 9, 3, 2, 1]


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    manager = KVCacheManager(4, BLOCK)  # 3 usable blocks
    first = hashed("a", list(range(8)))
    admit(manager, first)
    manager.free(first)  # both blocks cached and free: 3 free in all
    big = hashed("b", list(range(8)) + list(range(50, 62)))  # 5 blocks: 2 hits + 3 new
    hits, num_hit = manager.get_computed_blocks(big)
    assert num_hit == 8
    assert manager.allocate_slots(big, 12, hits) is None
    assert manager.num_free_blocks == 3
    assert [manager.block_pool.ref_cnt(b) for b in hits] == [0, 0]
    assert manager.get_block_ids("b") == []
    assert manager.allocate_slots(big, 4, hits) == [3]  # a smaller chunk fits


def test_full_sequence_must_fit_checks_the_whole_prompt() -> None:
    manager = KVCacheManager(4, BLOCK)  # 3 usable blocks
    request = hashed("r", list(range(16)))  # 4 blocks
    assert manager.allocate_slots(request, 4, full_sequence_must_fit=True) is None
    assert manager.allocate_slots(request, 4) == [1]


def test_reserved_blocks_are_kept_free() -> None:
    manager = KVCacheManager(5, BLOCK)
    request = hashed("r", list(range(16)))
    assert manager.allocate_slots(request, 16, reserved_blocks=1) is None
    assert manager.allocate_slots(request, 12, reserved_blocks=1) == [1, 2, 3]


def test_caching_off_never_hits_and_never_hashes() -> None:
    manager = KVCacheManager(10, BLOCK, enable_caching=False)
    admit(manager, hashed("a", list(range(12))))
    assert manager.get_computed_blocks(hashed("b", list(range(12)))) == ([], 0)
    assert manager.block_pool.num_cached_hashes == 0


def test_prompt_logprobs_skip_reading_the_cache() -> None:
    manager = KVCacheManager(10, BLOCK)
    admit(manager, hashed("a", list(range(12))))
    assert manager.get_computed_blocks(hashed("b", list(range(12)), prompt_logprobs=1)) == ([], 0)


def test_drop_cached_on_free_forgets_this_requests_blocks() -> None:
    manager = KVCacheManager(10, BLOCK)
    request = hashed("a", list(range(12)))
    admit(manager, request)
    manager.free(request, drop_cached=True)
    assert manager.get_computed_blocks(hashed("b", list(range(12)))) == ([], 0)


def test_usage_and_reset() -> None:
    manager = KVCacheManager(5, BLOCK)
    request = hashed("a", list(range(8)))
    admit(manager, request)
    assert manager.usage == 0.5
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(hashed("b", list(range(9)))) == ([], 0)
