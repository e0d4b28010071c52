"""Invariants of the offload manager under random operation sequences, for each policy.

A pinned or not-ready chunk is never evicted; slot ids are unique and below capacity; lookup
agrees with the held set; reference counts are never negative except the not-ready marker and
equal the loads in flight; a refused ``prepare_store`` changes no chunk; a policy's lists hold
exactly the held chunks.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from shoal.tiers.books.keys import make_offload_key
from shoal.tiers.books.manager import LookupResult, OffloadManager
from shoal.tiers.books.policies import NOT_READY, ARCPolicy, LRUPolicy

NUM_SLOTS = 3
KEYS = [make_offload_key(i.to_bytes(2, "big")) for i in range(8)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=6)
offers = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3)


class ManagerMachine(RuleBasedStateMachine):
    policy = "lru"
    store_threshold = 0

    def __init__(self) -> None:
        super().__init__()
        self.m = OffloadManager(NUM_SLOTS, self.policy, self.store_threshold, max_tracker_size=4)
        self.loads: Counter[bytes] = Counter()  # pins the test holds

    def _snapshot(self) -> dict[bytes, tuple[int, int]]:
        return {k: (c.slot_id, c.ref_cnt) for k, c in self.m.chunks.items()}

    @rule(offer=offers)
    def prepare_store(self, offer: list[bytes]) -> None:
        before = self._snapshot()
        busy = {k for k, c in self.m.chunks.items() if c.ref_cnt != 0}
        out = self.m.prepare_store(offer)
        if out is None:
            assert self._snapshot() == before
            return
        event(f"evicted {min(len(out.evicted_keys), 2)}")
        assert len(out.keys_to_store) == len(out.slot_ids)
        assert not set(out.evicted_keys) & (set(offer) | busy)
        assert not set(out.keys_to_store) & set(before)
        assert set(before) - set(self.m.chunks) == set(out.evicted_keys)
        for k in out.keys_to_store:
            assert self.m.lookup(k) is LookupResult.HIT_PENDING

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        pending = [k for k, c in self.m.chunks.items() if c.ref_cnt == NOT_READY]
        some = st.lists(st.sampled_from(pending), max_size=3) if pending else st.just([])
        done = data.draw(st.just(pending) | some)
        ready_before = {k for k, c in self.m.chunks.items() if c.is_ready}
        self.m.complete_store([*done, KEYS[0]], success)  # a stray or ready key is ignored
        assert ready_before <= set(self.m.chunks)
        for k in done:
            assert (self.m.lookup(k) is LookupResult.HIT) == success

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        ready = [k for k, c in self.m.chunks.items() if c.is_ready]
        if not ready:
            return
        load = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3))
        slots = self.m.prepare_load(load)
        assert slots == [self.m.chunks[k].slot_id for k in load]
        self.loads.update(load)

    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        held = list(self.loads.elements())
        if not held:
            return
        done = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=1))
        self.m.complete_load(done)
        self.loads.subtract(done)
        self.loads = +self.loads

    @rule(touched=key_lists)
    def touch(self, touched: list[bytes]) -> None:
        self.m.touch(touched)

    @rule(touched=key_lists, data=st.data())
    def request_finished(self, touched: list[bytes], data: st.DataObject) -> None:
        inserted = data.draw(st.sets(st.sampled_from(touched))) if touched else set()
        self.m.on_request_finished(touched, inserted)

    @invariant()
    def slots_are_unique_and_in_range(self) -> None:
        slots = [c.slot_id for c in self.m.chunks.values()]
        assert len(slots) == len(set(slots)) <= NUM_SLOTS
        assert all(0 <= s < NUM_SLOTS for s in slots)

    @invariant()
    def ref_counts_match_the_loads(self) -> None:
        for k, c in self.m.chunks.items():
            assert c.ref_cnt >= NOT_READY
            assert c.ref_cnt == (NOT_READY if c.ref_cnt == NOT_READY else self.loads[k])
        assert set(self.loads) <= set(self.m.chunks)

    @invariant()
    def the_threshold_tracker_is_bounded(self) -> None:
        assert len(self.m.store_filter) <= 4

    @invariant()
    def lookup_agrees_with_the_held_set(self) -> None:
        for k in KEYS:
            chunk = self.m.chunks.get(k)
            expected = (
                LookupResult.MISS
                if chunk is None
                else LookupResult.HIT
                if chunk.is_ready
                else LookupResult.HIT_PENDING
            )
            assert self.m.lookup(k) is expected

    @invariant()
    def policy_holds_exactly_the_chunks(self) -> None:
        policy = self.m.policy
        if isinstance(policy, LRUPolicy):
            assert sorted(policy.order()) == sorted(self.m.chunks)
        elif isinstance(policy, ARCPolicy):
            assert not set(policy.t1) & set(policy.t2)
            assert set(policy.t1) | set(policy.t2) == set(self.m.chunks)
            assert not (set(policy.b1) | set(policy.b2)) & set(self.m.chunks)
            assert len(policy.b1) <= NUM_SLOTS and len(policy.b2) <= NUM_SLOTS
            assert 0 <= policy.target_t1_size <= NUM_SLOTS


class ARCMachine(ManagerMachine):
    policy = "arc"


class ThresholdMachine(ManagerMachine):
    store_threshold = 2


for machine in (ManagerMachine, ARCMachine, ThresholdMachine):
    machine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)

TestLRUManager = ManagerMachine.TestCase
TestARCManager = ARCMachine.TestCase
TestThresholdManager = ThresholdMachine.TestCase
