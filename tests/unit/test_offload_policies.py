"""Eviction policies: ARC's lists and adaptive target as vLLM defines them, LRU's request order,
and the registry by name."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import pytest

from shoal.tiers.books.keys import OffloadKey, make_offload_key
from shoal.tiers.books.manager import OffloadManager
from shoal.tiers.books.policies import _POLICIES as REGISTRY
from shoal.tiers.books.policies import (
    ARCPolicy,
    Chunk,
    EvictionPolicy,
    LRUPolicy,
    make_policy,
    policy_names,
    register_policy,
)


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"))


def keys(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


def ids(found: Sequence[bytes] | None) -> list[int]:
    assert found is not None
    return [int.from_bytes(k[:8], "big") for k in found]


def arc_manager(num_slots: int) -> tuple[OffloadManager, ARCPolicy]:
    m = OffloadManager(num_slots, eviction_policy="arc")
    assert isinstance(m.policy, ARCPolicy)
    return m, m.policy


def store(m: OffloadManager, *key_ids: int) -> list[int]:
    out = m.prepare_store(keys(*key_ids))
    assert out is not None
    m.complete_store(out.keys_to_store)
    return ids(out.evicted_keys)


# -- ARC --------------------------------------------------------------------------------------


def test_arc_insert_goes_to_t1_and_reuse_of_a_ready_chunk_promotes_it() -> None:
    m, arc = arc_manager(4)
    store(m, 1, 2)
    assert (ids(list(arc.t1)), ids(list(arc.t2))) == ([2, 1], [])  # head most recent
    m.touch(keys(1))
    assert (ids(list(arc.t1)), ids(list(arc.t2))) == ([2], [1])
    store(m, 3)
    m.touch(keys(1, 3))  # tail first: 3 is promoted, then the head 1 goes to T2's recent end
    assert ids(list(arc.t2)) == [3, 1]


def test_arc_a_chunk_being_written_is_not_a_frequency_hit() -> None:
    m, arc = arc_manager(4)
    m.prepare_store(keys(1, 2))
    m.touch(keys(2))
    assert (ids(list(arc.t1)), ids(list(arc.t2))) == ([1, 2], [])  # 2 only more recent
    m.complete_store(keys(1, 2))
    m.touch(keys(2))
    assert ids(list(arc.t2)) == [2]


def test_arc_a_request_that_only_stored_a_chunk_does_not_promote_it() -> None:
    m, arc = arc_manager(4)
    store(m, 1, 2, 3)
    m.on_request_finished(keys(1, 2, 3), inserted_keys=keys(2, 3))
    assert (ids(list(arc.t1)), ids(list(arc.t2))) == ([3, 2], [1])


def test_arc_evicts_t1_while_it_is_at_least_the_target() -> None:
    m, arc = arc_manager(4)
    store(m, 1, 2, 3, 4)
    m.touch(keys(3, 4))  # T1: 2, 1; T2: 4, 3
    assert arc.target_t1_size == 0
    assert store(m, 5) == [2]  # |T1| = 2 >= 0
    assert (ids(list(arc.b1)), ids(list(arc.b2))) == ([2], [])


def test_arc_t1_at_exactly_the_target_still_gives_the_victim() -> None:
    m, arc = arc_manager(4)
    store(m, 1, 2, 3, 4)
    m.touch(keys(3, 4))  # T1: 2, 1; T2: 4, 3
    arc.target_t1_size = 2
    assert store(m, 5) == [2]  # |T1| == target: from T1
    arc.target_t1_size = 3
    assert store(m, 6) == [4]  # |T1| = 2 < target: from T2


def test_arc_b1_ghost_hit_grows_the_target_and_then_t2_gives_way() -> None:
    m, arc = arc_manager(4)
    store(m, 1, 2, 3, 4)
    m.touch(keys(3, 4))  # T1: 2, 1; T2: 4, 3
    store(m, 5)  # evicts 2 → B1
    m.touch(keys(2))  # ghost hit in B1: target += max(1, 0 // 1)
    assert arc.target_t1_size == 1
    store(m, 6)  # T1 = [1, 5], |T1| = 2 >= 1: T1 again
    assert ids(list(arc.b1)) == [2, 1]
    m.touch(keys(2))
    m.touch(keys(1))
    assert arc.target_t1_size == 3  # T1 = [6, 5] is below it now
    assert store(m, 7) == [4]  # so the victim comes from T2
    assert ids(list(arc.b2)) == [4]


def test_arc_b1_step_is_the_ghost_ratio() -> None:
    m, arc = arc_manager(8)
    arc.b1.update(dict.fromkeys(keys(1)))
    arc.b2.update(dict.fromkeys(keys(2, 3, 4)))
    m.touch(keys(1))
    assert arc.target_t1_size == 3  # max(1, 3 // 1)
    m.touch(keys(3))
    assert arc.target_t1_size == 2  # B2 hit: max(1, 1 // 3) = 1


def test_arc_b2_ghost_hit_shrinks_the_target_by_the_ratio_and_not_below_zero() -> None:
    m, arc = arc_manager(8)
    arc.target_t1_size = 5
    arc.b1.update(dict.fromkeys(keys(1, 2, 3, 4)))
    arc.b2.update(dict.fromkeys(keys(9, 10)))
    m.touch(keys(9))
    assert arc.target_t1_size == 3  # max(1, 4 // 2)
    m.touch(keys(10))
    m.touch(keys(10))
    assert arc.target_t1_size == 0


def test_arc_target_never_exceeds_capacity() -> None:
    m, arc = arc_manager(2)
    arc.b1.update(dict.fromkeys(keys(1)))
    arc.b2.update(dict.fromkeys(keys(2, 3, 4, 5)))
    m.touch(keys(1))
    assert arc.target_t1_size == 2


def test_arc_falls_back_to_t1_when_t2_has_no_idle_chunk() -> None:
    m, arc = arc_manager(3)
    store(m, 1, 2, 3)
    m.touch(keys(3))  # T1: 2, 1; T2: 3
    arc.target_t1_size = 3  # prefer T2
    m.prepare_load(keys(3))  # ... whose only chunk is pinned
    assert store(m, 4) == [2]


def test_arc_storing_a_ghost_drops_it_from_the_ghost_lists() -> None:
    m, arc = arc_manager(2)
    store(m, 1, 2)
    store(m, 3)  # 2 → B1 (tail first)
    assert ids(list(arc.b1)) == [2]
    store(m, 2)
    assert 2 not in ids(list(arc.b1)) and 2 in ids(list(arc.t1))


def test_arc_ghost_lists_hold_at_most_capacity_keys() -> None:
    m, arc = arc_manager(2)
    for i in range(10):
        store(m, i)
    assert ids(list(arc.b1)) == [6, 7]
    for i in range(10, 16):
        store(m, i)
        m.touch(keys(i))  # promote to T2 so T2 evicts too
    assert len(arc.b1) <= 2 and len(arc.b2) <= 2


def test_arc_batch_eviction_is_atomic() -> None:
    m, arc = arc_manager(4)
    store(m, 1, 2, 3, 4)
    m.touch(keys(1))
    m.prepare_load(keys(2))
    before = [list(x) for x in (arc.t1, arc.t2, arc.b1, arc.b2)]
    assert m.prepare_store(keys(5, 6, 7, 8)) is None  # 4 victims needed, 3 idle
    assert [list(x) for x in (arc.t1, arc.t2, arc.b1, arc.b2)] == before
    assert arc.evict(3, protected=set()) is not None
    assert len(arc.b1) + len(arc.b2) == 3


def test_arc_never_evicts_a_protected_key() -> None:
    m, arc = arc_manager(2)
    store(m, 1, 2)
    assert ids(list(arc.t1)) == [2, 1]  # 2 is the oldest ...
    assert m.prepare_store(keys(2, 3)) is not None  # ... but offered again: 1 goes
    assert key(2) in m.chunks and key(1) not in m.chunks


# -- LRU --------------------------------------------------------------------------------------


def test_lru_evicts_a_requests_tail_before_its_head() -> None:
    m = OffloadManager(3)
    assert isinstance(m.policy, LRUPolicy)
    store(m, 1, 2, 3)
    assert ids(m.policy.order()) == [3, 2, 1]
    m.touch(keys(3))
    assert ids(m.policy.evict(2, protected=set())) == [2, 1]


def test_lru_touch_of_an_unknown_key_is_ignored() -> None:
    m = OffloadManager(2)
    store(m, 1)
    m.touch(keys(7, 1))
    assert isinstance(m.policy, LRUPolicy) and ids(m.policy.order()) == [1]


def test_lru_batch_eviction_is_atomic() -> None:
    m = OffloadManager(3)
    store(m, 1, 2, 3)
    assert isinstance(m.policy, LRUPolicy)
    assert m.policy.evict(3, protected={key(2)}) is None
    assert ids(m.policy.order()) == [3, 2, 1]
    assert m.policy.evict(0, protected=set()) == []


# -- registry ---------------------------------------------------------------------------------


class _FIFO(EvictionPolicy):
    def __init__(self, capacity: int, chunks: dict[OffloadKey, Chunk]) -> None:
        super().__init__(capacity, chunks)
        self.order: list[OffloadKey] = []

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        self.order += keys

    def remove(self, key: OffloadKey) -> None:
        self.order.remove(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        pass

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        victims = [k for k in self.order if self._is_candidate(k, protected)][:n]
        if len(victims) < n:
            return None
        for k in victims:
            self.order.remove(k)
        return victims

    def clear(self) -> None:
        self.order.clear()


def test_lru_and_arc_are_registered() -> None:
    assert {"lru", "arc"} <= set(policy_names())
    assert isinstance(make_policy("arc", 4, {}), ARCPolicy)


def test_a_custom_policy_is_registered_by_name() -> None:
    register_policy("test-fifo", _FIFO)
    try:
        m = OffloadManager(2, eviction_policy="test-fifo")
        store(m, 1, 2)
        m.touch(keys(1))
        assert store(m, 3) == [1]
        with pytest.raises(ValueError, match="already registered"):
            register_policy("test-fifo", _FIFO)
    finally:
        REGISTRY.pop("test-fifo", None)


def test_registry_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_policy("lru", LRUPolicy)
    with pytest.raises(TypeError, match="EvictionPolicy"):
        register_policy("not-a-policy", dict)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="known: arc, lru"):
        make_policy("lfu", 4, {})
