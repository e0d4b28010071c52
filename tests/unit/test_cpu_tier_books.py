"""The CPU tier's pure books: per-owner leases (``OwnerLeases``) and ``CpuTierBooks`` over a real
``OffloadManager`` (pins only through their owner, expiry, promotion and cascade bookkeeping)."""

from __future__ import annotations

import pytest

from shoal.tiers.books.cpu_books import CASCADE_OWNER, PROMOTE_OWNER, CpuTierBooks
from shoal.tiers.books.manager import LookupResult, OffloadManager
from shoal.tiers.books.owners import OwnerLeases

K = [bytes([i]) * 8 for i in range(8)]
A, B = "engine-a/1", "engine-b/1"


def books_with(num_slots: int, ready: list[bytes]) -> CpuTierBooks:
    books = CpuTierBooks(OffloadManager(num_slots))
    books.prepare_store(A, ready, 0.0)
    assert books.release(A, [], ready, []) == ready
    return books


def ref_cnt(books: CpuTierBooks, key: bytes) -> int:
    return books.manager.chunks[key].ref_cnt


# -- OwnerLeases ---------------------------------------------------------------------------------


def test_an_owner_gives_back_only_its_own_pins_one_per_key_named():
    leases = OwnerLeases()
    leases.add_pins(A, [K[0], K[0], K[1]], 1.0)
    leases.add_pins(B, [K[1]], 1.0)
    assert leases.take_pins(A, [K[0], K[2], K[3]]) == [K[0]]
    assert leases.take_pins("engine-c/9", [K[0]]) == []
    assert leases.take_pins(A, [K[0], K[0], K[1]]) == [K[0], K[1]]
    assert (leases.num_pins, leases.owners()) == (1, [B])


def test_stores_are_taken_once_and_only_by_their_owner():
    leases = OwnerLeases()
    leases.add_stores(A, [K[0], K[1]], 1.0)
    assert leases.take_stores(B, [K[0]]) == []
    assert leases.take_stores(A, [K[1], K[1], K[2]]) == [K[1]]
    assert leases.take_stores(A, [K[1]]) == []
    assert leases.num_stores == 1


def test_renew_restarts_the_lease_of_what_the_owner_names_and_holds():
    leases = OwnerLeases()
    leases.add_pins(A, [K[0], K[0], K[1]], 1.0)
    leases.add_stores(A, [K[2]], 1.0)
    leases.add_pins(B, [K[3]], 1.0)
    assert leases.renew(A, [K[0], K[0], K[2], K[3], K[4]], 5.0) == 3  # K[3]: B's; K[4]: nobody's
    assert leases.renew("engine-c/9", [K[0]], 5.0) == 0
    expired = leases.expire(cutoff=3.0)
    assert (sorted(expired.pins), expired.stores) == ([K[1], K[3]], [])
    assert leases.take_pins(A, [K[0], K[0]]) == [K[0], K[0]]
    assert leases.take_stores(A, [K[2]]) == [K[2]]


def test_renew_counts_pins_a_key_named_once_renews_one_pin():
    """Pins the owner does not name (a lookup it gave up on after the tier pinned) keep ageing:
    a key named once renews one pin of it, and its pending store takes an entry first."""
    leases = OwnerLeases()
    leases.add_pins(A, [K[0], K[0], K[0]], 1.0)
    leases.add_pins(A, [K[1]], 1.0)
    leases.add_stores(A, [K[2]], 1.0)
    leases.add_pins(A, [K[2]], 1.0)
    assert leases.renew(A, [K[0], K[1], K[1], K[1], K[2]], 5.0) == 3  # K[1]: one pin to renew
    expired = leases.expire(cutoff=3.0)
    assert sorted(expired.pins) == [K[0], K[0], K[2]] and expired.stores == []
    assert (leases.num_pins, leases.num_stores) == (2, 1)
    assert leases.renew(A, [K[0], K[0], K[2]], 7.0) == 2  # one K[0] pin left to renew
    assert leases.expire(cutoff=6.0).pins == [K[1]]
    assert leases.take_pins(A, [K[0], K[0]]) == [K[0]]
    assert leases.take_stores(A, [K[2]]) == [K[2]]


def test_expire_takes_what_is_older_than_the_cutoff_and_keeps_the_rest():
    leases = OwnerLeases()
    leases.add_pins(A, [K[0]], 1.0)
    leases.add_pins(A, [K[0]], 5.0)
    leases.add_stores(A, [K[1]], 1.0)
    leases.add_stores(B, [K[2]], 5.0)
    expired = leases.expire(cutoff=3.0)
    assert (expired.pins, expired.stores, expired.owners) == ([K[0]], [K[1]], [A])
    assert (leases.num_pins, leases.num_stores) == (1, 1)
    assert leases.take_pins(A, [K[0]]) == [K[0]]  # the younger pin is still there
    later = leases.expire(cutoff=10.0)
    assert (later.pins, later.stores, later.owners) == ([], [K[2]], [B])
    assert leases.owners() == []


# -- CpuTierBooks ----------------------------------------------------------------------------


def test_lookup_pins_the_hit_run_and_counts_the_pending_run_after_it():
    books = books_with(8, [K[0], K[1]])
    books.prepare_store(B, [K[2], K[3]], 0.0)  # being written
    head = books.lookup_head(A, [K[0], K[1], K[2], K[3], K[4]], 0.0)
    assert (len(head.slot_ids), head.num_pending, head.may_promote) == (2, 2, False)
    assert [ref_cnt(books, k) for k in K[:2]] == [1, 1]
    after_pending = books.lookup_head(A, [K[0], K[2], K[1]], 0.0)  # a HIT after it: stop
    assert (len(after_pending.slot_ids), after_pending.num_pending) == (1, 1)
    miss = books.lookup_head(A, [K[0], K[5], K[1]], 0.0)
    assert (len(miss.slot_ids), miss.num_pending, miss.may_promote) == (1, 0, True)
    assert books.counters.num_hit_chunks == 4


def test_a_release_unpins_only_what_its_owner_pinned():
    books = books_with(4, [K[0], K[1]])
    books.lookup_head(A, [K[0]], 0.0)
    books.lookup_head(B, [K[0], K[1]], 0.0)
    books.release(A, [K[0], K[1], K[2]], [], [])  # K[1] is B's, K[2] is nobody's
    assert [ref_cnt(books, k) for k in K[:2]] == [1, 1]
    books.release(A, [K[0]], [], [])  # A holds nothing any more
    assert ref_cnt(books, K[0]) == 1
    books.release(B, [K[0], K[1]], [], [])
    assert [ref_cnt(books, k) for k in K[:2]] == [0, 0]


def test_failed_and_foreign_stores_leave_the_owner_of_a_key_alone():
    books = CpuTierBooks(OffloadManager(4))
    books.prepare_store(A, [K[0], K[1]], 0.0)
    assert books.release(B, [], [K[0]], [K[1]]) == []  # not B's writes
    assert books.release(A, [], [K[0]], [K[1]]) == [K[0]]
    assert books.manager.lookup(K[0]) is LookupResult.HIT
    assert books.manager.lookup(K[1]) is LookupResult.MISS
    assert books.manager.num_used_slots == 1


def test_expired_leases_unpin_and_fail_so_the_slots_can_be_reused():
    books = books_with(2, [K[0]])
    books.lookup_head(A, [K[0]], 1.0)
    books.prepare_store(A, [K[1]], 1.0)
    assert books.manager.prepare_store([K[2]]) is None  # pinned and pending: no room
    assert books.expire(cutoff=2.0) == [A]
    assert ref_cnt(books, K[0]) == 0
    assert books.manager.lookup(K[1]) is LookupResult.MISS
    assert (books.counters.num_pins_expired, books.counters.num_stores_expired) == (1, 1)
    books.release(A, [K[0]], [K[1]], [])  # too late: ignored, no error
    assert books.manager.prepare_store([K[2], K[3]]) is not None


def test_a_promotion_makes_the_keys_read_readable_and_frees_the_others():
    books = CpuTierBooks(OffloadManager(4))
    reserved = books.reserve_promotion([K[0], K[1], K[2]], 0.0)
    assert reserved is not None and reserved.keys == [K[0], K[1], K[2]]
    assert books.finish_promotion(reserved, [K[0], K[1]]) == [K[0], K[1]]
    assert books.manager.num_used_slots == 2
    more = books.lookup_more(A, [K[0], K[1], K[2]], 0.0)
    assert (len(more.slot_ids), more.may_promote, more.promotion) == (2, True, None)
    assert (books.counters.num_promoted, books.counters.num_promote_failures) == (2, 1)
    assert books.leases.owners() == [A] and books.num_promotions_in_flight == 0


def test_store_threshold_holds_back_engine_offers_but_never_a_promotion():
    books = CpuTierBooks(OffloadManager(4, store_threshold=2))
    offered = books.prepare_store(A, [K[0]], 0.0)
    assert offered is not None and offered.keys_to_store == []  # offered once: held back
    reserved = books.reserve_promotion([K[1]], 0.0)
    assert reserved is not None and reserved.keys == [K[1]]


def test_a_promotion_that_never_answered_is_freed_by_its_lease():
    books = CpuTierBooks(OffloadManager(2))
    reserved = books.reserve_promotion([K[0]], 1.0)
    assert reserved is not None
    assert books.expire(cutoff=2.0) == [PROMOTE_OWNER]
    assert books.manager.num_used_slots == 0
    assert books.lookup_head(A, [K[0]], 3.0).promotion is None  # nothing brings it now
    assert books.finish_promotion(reserved, [K[0]]) == []  # a late answer changes nothing
    assert books.manager.num_used_slots == 0


def test_a_cascade_pins_until_its_answer_or_its_lease():
    books = books_with(2, [K[0], K[1]])
    books.pin_for_cascade([K[0], K[1]], 1.0)
    books.pin_for_cascade([K[0]], 5.0)
    assert books.manager.prepare_store([K[2]]) is None
    books.finish_cascade([K[0], K[1]], num_done=1)
    assert [ref_cnt(books, k) for k in K[:2]] == [1, 0]
    assert (books.counters.num_cascaded, books.counters.num_cascade_failures) == (1, 1)
    assert books.expire(cutoff=10.0) == [CASCADE_OWNER]
    assert ref_cnt(books, K[0]) == 0
    books.finish_cascade([K[0]], num_done=0)  # after its lease: no double unpin
    assert ref_cnt(books, K[0]) == 0


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_lookup_hit_is_a_reuse_for_the_policy(policy):
    books = CpuTierBooks(OffloadManager(2, eviction_policy=policy))
    for key in K[:2]:
        books.prepare_store(A, [key], 0.0)
        books.release(A, [], [key], [])
    books.lookup_head(A, [K[0]], 0.0)  # K[0] reused: K[1] is the one to go
    books.release(A, [K[0]], [], [])
    output = books.prepare_store(A, [K[2]], 0.0)
    assert output is not None and output.evicted_keys == [K[1]]


# -- promotions in flight ---------------------------------------------------------------------


def test_a_lookup_learns_which_promotion_brings_its_next_key_and_an_engine_store_has_none():
    books = books_with(8, [K[0]])
    promotion = books.reserve_promotion([K[1], K[2]], 0.0)
    assert promotion is not None and books.num_promotions_in_flight == 1
    head = books.lookup_head(A, [K[0], K[1], K[2], K[3]], 0.0)
    assert (len(head.slot_ids), head.num_pending, head.may_promote) == (1, 2, False)
    assert head.promotion == promotion.promotion_id
    books.prepare_store(B, [K[4]], 0.0)  # an engine core's store being copied
    store = books.lookup_head(A, [K[4], K[5]], 0.0)
    assert (store.slot_ids, store.num_pending, store.promotion) == ([], 1, None)
    assert books.lookup_head(A, [K[1]], 0.0, use_held=False).promotion is None  # never waits


def test_keys_already_being_promoted_are_left_to_that_promotion():
    books = CpuTierBooks(OffloadManager(8))
    first = books.reserve_promotion([K[0], K[1]], 0.0)
    assert first is not None
    assert books.reserve_promotion([K[0], K[1]], 0.0) is None  # nothing left to read
    second = books.reserve_promotion([K[0], K[1], K[2]], 0.0)
    assert second is not None and second.keys == [K[2]]
    head = books.lookup_head(A, [K[0], K[1], K[2]], 0.0)
    assert head.promotion == first.promotion_id and head.num_pending == 3
    books.finish_promotion(first, [K[0], K[1]])
    after_first = books.lookup_more(A, [K[0], K[1], K[2]], 0.0, reused=True)
    assert (len(after_first.slot_ids), after_first.promotion) == (2, second.promotion_id)


def test_after_the_promotion_the_waiter_pins_its_own_run_without_a_second_query():
    books = CpuTierBooks(OffloadManager(4))
    promotion = books.reserve_promotion([K[0], K[1]], 0.0)
    assert promotion is not None
    books.finish_promotion(promotion, [K[0], K[1]])
    assert books.lookup_more(A, [K[0], K[1]], 0.0).slot_ids == promotion.slot_ids  # promoter
    num_queries = books.manager.stats.num_queries
    waiter = books.lookup_more(B, [K[0], K[1], K[2]], 0.0, reused=True)
    assert waiter.slot_ids == promotion.slot_ids and waiter.may_promote
    assert books.manager.stats.num_queries == num_queries  # a lookup is one query per key
    assert [ref_cnt(books, k) for k in K[:2]] == [2, 2]
    books.release(A, [K[0], K[1]], [], [])
    assert [ref_cnt(books, k) for k in K[:2]] == [1, 1]  # the waiter's pins are its own
    assert books.num_promotions_in_flight == 0 and books.counters.num_promoted == 2


def test_a_partly_failed_promotion_leaves_its_successful_run_and_a_miss_after_it():
    books = CpuTierBooks(OffloadManager(4))
    promotion = books.reserve_promotion([K[0], K[1], K[2]], 0.0)
    assert promotion is not None
    assert books.finish_promotion(promotion, [K[0]]) == [K[0]]
    more = books.lookup_more(A, [K[0], K[1], K[2]], 0.0, reused=True)
    assert (len(more.slot_ids), more.num_pending, more.may_promote) == (1, 0, True)
    assert (books.manager.num_used_slots, books.leases.num_stores) == (1, 0)
    assert books.counters.num_promote_failures == 2


def test_an_abandoned_promotion_keeps_its_slots_but_nobody_waits_for_it():
    books = CpuTierBooks(OffloadManager(2))
    promotion = books.reserve_promotion([K[0]], 1.0)
    assert promotion is not None
    books.abandon_promotion(promotion)
    head = books.lookup_head(A, [K[0]], 1.5)
    assert (head.num_pending, head.promotion, head.may_promote) == (1, None, False)
    assert books.num_promotions_in_flight == 0 and books.manager.num_used_slots == 1
    assert books.expire(cutoff=2.0) == [PROMOTE_OWNER]  # the lease frees the slot
    assert books.manager.num_used_slots == 0


def test_an_abandoned_promotion_finished_past_its_deadline_frees_its_slots():
    books = CpuTierBooks(OffloadManager(2))
    promotion = books.reserve_promotion([K[0], K[1]], 1.0)
    assert promotion is not None
    books.abandon_promotion(promotion)
    assert books.finish_promotion(promotion, []) == []
    assert books.manager.num_used_slots == 0 and books.leases.num_stores == 0
    assert books.counters.num_promote_failures == 2
    assert books.lookup_head(A, [K[0]], 1.5).may_promote  # a miss now: promote it again


def test_a_late_finish_never_settles_a_key_another_promotion_holds_now():
    """P1's reservation expires, P2 reserves the same key (another slot, unwritten): P1's
    late answer must not make P2's slot readable."""
    books = CpuTierBooks(OffloadManager(2))
    first = books.reserve_promotion([K[0]], 1.0)
    assert first is not None
    books.expire(cutoff=2.0)
    second = books.reserve_promotion([K[0]], 3.0)
    assert second is not None
    assert books.finish_promotion(first, [K[0]]) == []
    assert books.manager.lookup(K[0]) is LookupResult.HIT_PENDING  # still P2's to write
    assert books.finish_promotion(second, [K[0]]) == [K[0]]
    assert books.manager.lookup(K[0]) is LookupResult.HIT


def test_a_lease_that_outlives_a_promotion_in_flight_ends_it_for_waiters_too():
    books = CpuTierBooks(OffloadManager(4))
    promotion = books.reserve_promotion([K[0], K[1]], 1.0)
    later = books.reserve_promotion([K[2]], 5.0)
    assert promotion is not None and later is not None
    books.expire(cutoff=2.0)
    assert books.lookup_head(A, [K[0]], 3.0).may_promote  # gone: a miss, not a wait
    books.prepare_store(B, [K[0]], 3.0)  # an engine core stores it again: nothing to wait for
    assert books.lookup_head(A, [K[0]], 3.0).promotion is None
    assert books.lookup_head(A, [K[2]], 3.0).promotion == later.promotion_id
    assert promotion.keys == [K[0], K[1]]  # the caller's record is left alone
    assert books.finish_promotion(promotion, [K[0], K[1]]) == []
    assert books.num_promotions_in_flight == 1
    assert books.manager.lookup(K[0]) is LookupResult.HIT_PENDING  # still the engine's store


def test_only_its_own_promoted_keys_count_for_a_request_that_may_not_use_held_ones():
    books = books_with(4, [K[1]])
    promotion = books.reserve_promotion([K[0]], 0.0)
    assert promotion is not None
    promoted = books.finish_promotion(promotion, [K[0]])
    more = books.lookup_more(A, [K[0], K[1], K[2]], 0.0, only=promoted)
    assert (len(more.slot_ids), more.may_promote, more.num_pending) == (1, False, 0)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_run_pinned_after_waiting_is_a_reuse_and_the_promoters_is_not(policy):
    books = CpuTierBooks(OffloadManager(2, eviction_policy=policy))
    for key in (K[0], K[1]):
        promotion = books.reserve_promotion([key], 0.0)
        assert promotion is not None
        books.finish_promotion(promotion, [key])
    books.lookup_more(B, [K[0]], 0.0, reused=True)  # K[0]: B waited for it, a reuse
    books.lookup_more(A, [K[1]], 0.0)  # K[1] came by A's own promotion: no reuse
    books.release(A, [K[1]], [], [])
    books.release(B, [K[0]], [], [])
    output = books.prepare_store(A, [K[2]], 0.0)
    assert output is not None and output.evicted_keys == [K[1]]
