"""SlotTable: which adapter sits in which of a worker's LoRA slots (least recently used out)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.workers.lora.slots import SlotTable


def test_num_slots_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        SlotTable(0)


def test_free_slots_are_handed_out_first_in_order() -> None:
    table = SlotTable(3)
    placement, writes = table.place([7])
    assert placement == {7: 0} and writes == [(7, 0)]
    placement, writes = table.place([8, 9])
    assert placement == {8: 1, 9: 2} and writes == [(8, 1), (9, 2)]
    assert table.num_evictions == 0
    assert table.resident == [7, 8, 9]


def test_resident_adapters_keep_their_slot_and_are_not_written_again() -> None:
    table = SlotTable(2)
    table.place([1, 2])
    placement, writes = table.place([2, 1])
    assert placement == {1: 0, 2: 1}
    assert writes == []
    assert table.num_evictions == 0


def test_repeated_ids_in_one_step_count_once() -> None:
    table = SlotTable(1)
    placement, writes = table.place([5, 5, 5])
    assert placement == {5: 0} and writes == [(5, 0)]


def test_an_empty_step_changes_nothing() -> None:
    table = SlotTable(2)
    table.place([1])
    assert table.place([]) == ({}, [])
    assert table.resident == [1] and table.slot_of(1) == 0


def test_the_least_recently_used_unneeded_adapter_is_evicted() -> None:
    table = SlotTable(3)
    table.place([1, 2, 3])  # 1 is the least recently used
    table.place([1])  # now 2 is
    placement, writes = table.place([4])
    assert writes == [(4, 1)]  # 2's slot
    assert placement == {4: 1}
    assert table.slot_of(2) is None
    assert table.num_evictions == 1
    assert table.resident == [3, 1, 4]
    _, writes = table.place([5])  # then 3
    assert writes == [(5, 2)] and table.slot_of(3) is None
    assert table.num_evictions == 2


def test_an_adapter_the_step_needs_is_never_evicted() -> None:
    table = SlotTable(2)
    table.place([1, 2])  # 1 is the least recently used
    placement, writes = table.place([3, 1])  # 1 is needed: 2 goes though it is more recent
    assert placement == {1: 0, 3: 1}
    assert writes == [(3, 1)]
    assert table.slot_of(2) is None and table.num_evictions == 1


def test_the_least_recently_used_may_be_needed_by_the_step() -> None:
    table = SlotTable(3)
    table.place([1, 2, 3])
    # 1 and 2 are the two least recently used but needed: 3 is the only one to evict.
    placement, writes = table.place([4, 1, 2])
    assert writes == [(4, 2)]
    assert placement == {1: 0, 2: 1, 4: 2}
    assert table.resident == [1, 2, 4]


def test_more_adapters_than_slots_is_refused_without_changing_anything() -> None:
    table = SlotTable(2)
    table.place([1, 2])
    with pytest.raises(ValueError, match=r"3 adapters.*2 LoRA slots"):
        table.place([3, 4, 5])
    assert table.resident == [1, 2]
    assert table.num_evictions == 0


def test_remove_frees_its_slot_for_the_next_adapter() -> None:
    table = SlotTable(2)
    table.place([1, 2])
    assert table.remove(1) == 0
    assert table.slot_of(1) is None and table.resident == [2]
    assert table.remove(1) is None  # not resident any more
    assert table.remove(99) is None
    placement, writes = table.place([3])
    assert placement == {3: 0} and writes == [(3, 0)]
    assert table.num_evictions == 0  # a free slot, no eviction
    assert table.resident == [2, 3]


# ----- properties

_steps = st.integers(1, 4).flatmap(
    lambda num_slots: st.tuples(
        st.just(num_slots),
        st.lists(
            st.one_of(
                st.lists(st.integers(0, 7), max_size=num_slots, unique=True).map(
                    lambda ids: ("place", ids)
                ),
                st.integers(0, 7).map(lambda adapter_id: ("remove", [adapter_id])),
            ),
            max_size=30,
        ),
    )
)


@settings(max_examples=150, deadline=None)
@given(_steps)
def test_placements_stay_consistent_over_any_steps(
    case: tuple[int, list[tuple[str, list[int]]]],
) -> None:
    num_slots, operations = case
    table = SlotTable(num_slots)
    model: list[int] = []  # a reference LRU order, least recently used first
    num_evictions = 0
    for kind, ids in operations:
        before = {adapter_id: table.slot_of(adapter_id) for adapter_id in table.resident}
        if kind == "remove":
            (adapter_id,) = ids
            assert table.remove(adapter_id) == before.get(adapter_id)
            if adapter_id in model:
                model.remove(adapter_id)
            assert table.resident == model
            continue
        placement, writes = table.place(ids)
        # every wanted id has a slot in range, and no two share one
        assert set(placement) == set(ids)
        assert all(0 <= slot < num_slots for slot in placement.values())
        assert len(set(placement.values())) == len(placement)
        # the resident adapters' slots are pairwise distinct and agree with the placement
        slots = {adapter_id: table.slot_of(adapter_id) for adapter_id in table.resident}
        assert len(set(slots.values())) == len(slots) <= num_slots
        assert all(slots[adapter_id] == slot for adapter_id, slot in placement.items())
        # an adapter that stayed resident kept its slot
        for adapter_id, slot in before.items():
            if adapter_id in slots:
                assert slots[adapter_id] == slot
        # the writes are exactly the wanted ids not resident before, in the slots they got
        assert [adapter_id for adapter_id, _ in writes] == [i for i in ids if i not in before]
        assert all(placement[adapter_id] == slot for adapter_id, slot in writes)
        # least recently used out, and only when no slot is free
        for adapter_id in ids:
            if adapter_id in model:
                model.remove(adapter_id)
                model.append(adapter_id)
        for adapter_id in ids:
            if adapter_id in before:
                continue
            if len(model) == num_slots:
                victim = next(i for i in model if i not in ids)
                model.remove(victim)
                num_evictions += 1
            model.append(adapter_id)
        assert table.resident == model
        assert table.num_evictions == num_evictions
