"""KV events of the block pool: stored (in chain order, with the parent), removed, cleared;
replaying them gives exactly the pool's cached hashes (a property over random operations)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.bus.messages.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    snapshot_events,
)
from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.sampling import SamplingParams
from shoal.engine.client.prefix_index import PrefixIndex
from shoal.engine.core.block_pool import BlockPool
from shoal.engine.core.kv_cache_manager import KVCacheManager
from shoal.engine.core.kv_events import KVEventLog
from shoal.engine.core.request import Request
from tests.unit.factories import make_request


def h(i: int) -> bytes:
    return i.to_bytes(4, "little")


def logged_pool(num_blocks: int = 8) -> tuple[BlockPool, KVEventLog]:
    pool = BlockPool(num_blocks)
    pool.kv_events = KVEventLog(block_size=4)
    return pool, pool.kv_events


def test_nothing_is_logged_without_a_log_and_nothing_to_log_without_prefix_caching() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_blocks(blocks, [h(1), h(2)])  # no log attached: nothing recorded anywhere
    assert pool.kv_events is None
    assert KVCacheManager(4, 4, enable_caching=False).record_kv_events() is None
    manager = KVCacheManager(4, 4)
    assert manager.record_kv_events() is manager.record_kv_events()  # idempotent


def test_stored_runs_keep_chain_order_and_parent_and_skip_hashes_already_cached() -> None:
    pool, log = logged_pool()
    first = pool.get_new_blocks(2)
    pool.cache_blocks(first, [h(1), h(2)])
    second = pool.get_new_blocks(3)  # h(2) is already cached by another block: not stored again
    pool.cache_blocks(second, [h(5), h(2), h(6)], parent_hash=h(9))
    assert log.take() == [
        BlockStored([h(1), h(2)], None, 4),
        BlockStored([h(5)], h(9), 4),
        BlockStored([h(6)], h(2), 4),
    ]
    assert log.take() == []


def test_evictions_and_drops_are_removed_and_a_reset_is_cleared() -> None:
    pool, log = logged_pool(4)  # 3 usable blocks
    blocks = pool.get_new_blocks(3)
    pool.cache_blocks(blocks, [h(1), h(2), h(3)])
    pool.free_blocks(reversed(blocks))
    log.take()
    taken = pool.get_new_blocks(2)  # evicts the two least recently freed: h(3), h(2)
    assert log.take() == [BlockRemoved([h(2), h(3)])]  # in block id order
    block = pool.get_new_blocks(1)[0]  # evicts h(1)
    pool.cache_blocks([block], [h(7)])
    pool.free_blocks([block], drop_cached=True)
    assert log.take() == [BlockRemoved([h(1)]), BlockStored([h(7)], None, 4), BlockRemoved([h(7)])]
    pool.cache_blocks(pool.get_new_blocks(1), [h(8)])
    assert not pool.reset_prefix_cache()  # a block in use: refused, nothing logged
    assert log.take() == [BlockStored([h(8)], None, 4)]
    pool.free_blocks([pool.get_cached_block(h(8)), *taken])
    assert pool.reset_prefix_cache()
    assert log.take() == [AllBlocksCleared()]


def replay(batches: list[list[KVEvent]]) -> set[bytes]:
    index = PrefixIndex()
    for seq, events in enumerate(batches):
        index.apply(KVEventBatch("e0", "i0", seq, events))
    return index.hashes_of("e0")


OPS = st.lists(
    st.tuples(
        st.sampled_from(["take", "cache", "free", "drop", "touch", "reset", "step"]),
        st.integers(0, 30),
        st.integers(1, 3),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_replaying_the_events_gives_the_cached_hashes(ops: list[tuple[str, int, int]]) -> None:
    pool, log = logged_pool(8)
    held: list[int] = []
    batches: list[list[KVEvent]] = [snapshot_events([], 4)]
    for op, value, count in ops:
        if op == "take" and pool.num_free_blocks >= count:
            held.extend(pool.get_new_blocks(count))
        elif op == "cache" and held:
            unhashed = [block for block in held if pool.block_hash(block) is None][:count]
            pool.cache_blocks(unhashed, [h(value + i) for i in range(len(unhashed))], h(99))
        elif op in ("free", "drop") and held:
            pool.free_blocks([held.pop(value % len(held))], drop_cached=op == "drop")
        elif op == "touch" and (block := pool.get_cached_block(h(value))) is not None:
            pool.touch([block])
            held.append(block)
        elif op == "reset":
            pool.reset_prefix_cache()
        elif op == "step":
            batches.append(log.take())
        assert replay([*batches, log.events]) == set(pool.cached_hashes())


def test_the_manager_logs_a_requests_blocks_with_their_chain_parent() -> None:
    manager = KVCacheManager(16, 4)
    log = manager.record_kv_events()
    assert log is not None
    request = make_request("r", list(range(10)))
    request.block_hashes.extend(_hashes_of(request))
    assert manager.allocate_slots(request, 10) is not None
    (stored,) = log.take()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == request.block_hashes[:2] and stored.parent_block_hash is None


def test_blocks_of_a_request_with_an_adapter_are_stored_under_its_name() -> None:
    manager = KVCacheManager(16, 4)
    log = manager.record_kv_events()
    assert log is not None
    for request_id, lora in (("plain", None), ("sql", LoRARequest("sql", 1, "/adapters/sql"))):
        request = Request(request_id, list(range(10)), SamplingParams(), lora_request=lora)
        request.block_hashes.extend(_hashes_of(request))
        assert manager.allocate_slots(request, 10) is not None
    plain, sql = log.take()
    assert isinstance(plain, BlockStored) and isinstance(sql, BlockStored)
    assert plain.lora_name is None and sql.lora_name == "sql"
    assert not set(plain.block_hashes) & set(sql.block_hashes)


def _hashes_of(request: object) -> list[bytes]:
    from shoal.engine.core.block_hash import BlockHasher

    return BlockHasher(4)(request)  # type: ignore[arg-type]
