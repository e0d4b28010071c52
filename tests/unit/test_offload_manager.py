"""The offload manager's protocol, with vLLM's canonical LRU scenario (internals §13, KV offload).

Where the reference leaves a detail open, this file pins shoal's choice:

* the eviction for the store of [6, 7, 8] after the load of [2, 3] finished is the set {3, 4, 5}
  (the reference lists [4, 5, 3]); shoal evicts 5, 4, 3 in that order: 4 and 5 are older than the
  load request's keys, and within one request the tail (5) goes before the head, then 3 (the
  load request's tail) before 2;
* a request's access is committed by ``on_request_finished`` (or ``touch``), never by a load or a
  store completing;
* freed slots go to the free list in eviction order and are reused last-freed first.
"""

from __future__ import annotations

import pytest

from shoal.tiers.books.keys import make_offload_key
from shoal.tiers.books.manager import LookupResult, OffloadEvent, OffloadManager, PrepareStoreOutput

HIT, HIT_PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"))


def keys(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


def stored(*ids: int) -> OffloadEvent:
    return OffloadEvent(tuple(keys(*ids)), removed=False)


def evicted(*ids: int) -> OffloadEvent:
    return OffloadEvent(tuple(keys(*ids)), removed=True)


def out(store: list[int], slots: list[int], gone: list[int]) -> PrepareStoreOutput:
    return PrepareStoreOutput(keys(*store), slots, keys(*gone))


def test_canonical_lru_scenario() -> None:
    m = OffloadManager(num_slots=4, eviction_policy="lru")

    assert m.prepare_store(keys(1, 2)) == out([1, 2], [0, 1], [])
    assert [m.lookup(k) for k in keys(1, 2, 3)] == [HIT_PENDING, HIT_PENDING, MISS]
    assert m.take_events() == []
    m.complete_store(keys(1, 2))
    assert m.take_events() == [stored(1, 2)]
    assert [m.lookup(k) for k in keys(1, 2, 3)] == [HIT, HIT, MISS]

    # 2 is held already (skipped) and protected; 1 makes room for the third new key
    assert m.prepare_store(keys(2, 3, 4, 5)) == out([3, 4, 5], [2, 3, 0], [1])
    assert m.take_events() == [evicted(1)]
    assert m.prepare_store(keys(1, 6)) is None  # only 2 is idle: no room for two
    m.complete_store(keys(2, 3, 4, 5))

    assert m.prepare_load(keys(2, 3)) == [1, 2]
    assert m.prepare_store(keys(6, 7, 8)) is None  # 2, 3 pinned: only 4, 5 are idle
    m.complete_load(keys(2, 3))
    m.on_request_finished(keys(2, 3))  # the load request's access: 2, 3 are now the most recent

    assert m.prepare_store(keys(6, 7, 8)) == out([6, 7, 8], [2, 3, 0], [5, 4, 3])
    m.complete_store(keys(6, 7, 8))
    assert m.lookup(key(2)) == HIT

    m.touch(keys(2, 6))  # order, least recent first: 8, 7, 6, 2
    assert m.prepare_store(keys(9)) == out([9], [0], [8])

    m.complete_store(keys(7, 9), success=False)  # 7 was ready: kept; 9 never was: removed
    assert [m.lookup(k) for k in keys(7, 9)] == [HIT, MISS]
    assert m.take_events() == [stored(3, 4, 5), stored(6, 7, 8), evicted(5, 4, 3), evicted(8)]
    assert m.prepare_store(keys(10)) == out([10], [0], [])  # 9's slot came back


def test_without_the_request_access_the_oldest_chunks_go() -> None:
    """Loads do not change recency: the same scenario without on_request_finished evicts 2."""
    m = OffloadManager(4)
    m.prepare_store(keys(1, 2))
    m.complete_store(keys(1, 2))
    m.prepare_store(keys(2, 3, 4, 5))
    m.complete_store(keys(3, 4, 5))
    assert m.prepare_load(keys(2, 3)) == [1, 2]
    m.complete_load(keys(2, 3))
    assert m.prepare_store(keys(6, 7, 8)).evicted_keys == keys(2, 5, 4)  # type: ignore[union-attr]


def test_recency_follows_requests_not_completion_order() -> None:
    """Two requests' writes complete in reverse order; recency is what finishing commits."""
    m = OffloadManager(4)
    m.prepare_store(keys(1, 2))  # request A
    m.prepare_store(keys(3, 4))  # request B
    m.complete_store(keys(3, 4))
    m.complete_store(keys(1, 2))
    m.on_request_finished(keys(1, 2), inserted_keys=keys(1, 2))
    m.on_request_finished(keys(3, 4), inserted_keys=keys(3, 4))
    assert m.prepare_store(keys(5, 6)).evicted_keys == keys(2, 1)  # type: ignore[union-attr]


def test_store_skips_held_keys_and_repeats() -> None:
    m = OffloadManager(4)
    m.prepare_store(keys(1))
    assert m.prepare_store(keys(1, 2, 2, 1)) == out([2], [1], [])


def test_a_store_with_nothing_new_changes_nothing() -> None:
    m = OffloadManager(1)
    m.prepare_store(keys(1))
    assert m.prepare_store(keys(1)) == out([], [], [])


def test_not_ready_chunks_are_never_evicted() -> None:
    m = OffloadManager(2)
    m.prepare_store(keys(1, 2))
    assert m.prepare_store(keys(3)) is None
    m.complete_store(keys(1))
    assert m.prepare_store(keys(3)) == out([3], [0], [1])


def test_prepare_load_needs_ready_hits_and_keeps_key_order() -> None:
    m = OffloadManager(4)
    m.prepare_store(keys(1, 2, 3))
    with pytest.raises(ValueError, match="not a HIT"):
        m.prepare_load(keys(1))  # still being written
    m.complete_store(keys(1, 2, 3))
    with pytest.raises(ValueError, match="not a HIT"):
        m.prepare_load(keys(3, 4))
    assert m.chunks[key(3)].ref_cnt == 0  # nothing pinned by the refused call
    assert m.prepare_load(keys(3, 1, 2)) == [2, 0, 1]


def test_pins_count_and_unpin_only_what_was_pinned() -> None:
    m = OffloadManager(1)
    m.prepare_store(keys(1))
    m.complete_store(keys(1))
    m.prepare_load(keys(1))
    m.prepare_load(keys(1))
    m.complete_load(keys(1))
    assert m.prepare_store(keys(2)) is None  # one load still holds it
    m.complete_load(keys(1))
    with pytest.raises(ValueError, match="not being loaded"):
        m.complete_load(keys(1))
    assert m.prepare_store(keys(2)) == out([2], [0], [1])


def test_failed_store_frees_slots_without_events() -> None:
    m = OffloadManager(2)
    m.prepare_store(keys(1, 2))
    m.complete_store(keys(1, 2), success=False)
    assert m.take_events() == [] and m.num_used_slots == 0
    assert m.prepare_store(keys(3, 4)) == out([3, 4], [1, 0], [])  # free list, last freed first
    assert m.stats.num_store_failures == 2


def test_events_list_stores_before_evictions() -> None:
    m = OffloadManager(1)
    m.prepare_store(keys(1))
    m.complete_store(keys(1))
    m.prepare_store(keys(2))
    m.complete_store(keys(2))
    assert m.take_events() == [stored(1), stored(2), evicted(1)]
    assert m.take_events() == []


def test_usage_and_counters() -> None:
    m = OffloadManager(4, store_threshold=2)
    assert m.prepare_store(keys(1, 2)) == out([], [], [])
    assert m.stats.num_stores_skipped == 2
    m.prepare_store(keys(1))
    assert m.usage == 0.25
    m.lookup(key(1))
    m.lookup(key(2))
    assert (m.stats.num_queries, m.stats.num_hits) == (2, 1)
    m.complete_store(keys(1))
    assert m.stats.num_stored == 1


def test_store_threshold_stores_on_the_nth_offer() -> None:
    m = OffloadManager(8, store_threshold=3)
    for _ in range(2):
        assert m.prepare_store(keys(1)) == out([], [], [])
    assert m.prepare_store(keys(1, 2)) == out([1], [0], [])
    assert len(m.store_filter) == 1  # 2 still counted; 1 forgotten once stored


def test_store_threshold_counts_survive_a_refused_store() -> None:
    m = OffloadManager(1, store_threshold=2)
    m.prepare_store(keys(1))
    m.prepare_store(keys(1))
    m.prepare_store(keys(2))
    assert m.prepare_store(keys(2)) is None  # 1 is still being written
    m.complete_store(keys(1))
    assert m.prepare_store(keys(2)) == out([2], [0], [1])


def test_store_threshold_tracker_is_bounded() -> None:
    m = OffloadManager(8, store_threshold=2, max_tracker_size=3)
    for i in range(10):
        m.prepare_store(keys(i))
    assert len(m.store_filter) == 3
    assert m.prepare_store(keys(0)) == out([], [], [])  # its count was dropped: first offer again
    assert m.prepare_store(keys(9)) == out([9], [0], [])


@pytest.mark.parametrize("threshold", [0, 1])
def test_store_threshold_below_two_stores_at_once(threshold: int) -> None:
    m = OffloadManager(2, store_threshold=threshold)
    assert m.prepare_store(keys(1)) == out([1], [0], [])


def test_bad_configuration_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="slot"):
        OffloadManager(0)
    with pytest.raises(ValueError, match="eviction_policy 'mru'"):
        OffloadManager(4, eviction_policy="mru")
    with pytest.raises(ValueError, match="store_threshold"):
        OffloadManager(4, store_threshold=-1)


def test_discard_forgets_only_idle_ready_chunks() -> None:
    m = OffloadManager(num_slots=3)
    m.prepare_store(keys(1, 2, 3))
    m.complete_store(keys(1, 2))  # 3 is still being written
    m.prepare_load(keys(2))  # 2 is pinned
    m.take_events()
    assert m.discard(keys(1, 2, 3, 9)) == keys(1)
    assert [m.lookup(k) for k in keys(1, 2, 3)] == [MISS, HIT, HIT_PENDING]
    assert m.take_events() == [evicted(1)]
    assert m.prepare_store(keys(4)) == out([4], [0], [])  # its slot is free again, not evicted
