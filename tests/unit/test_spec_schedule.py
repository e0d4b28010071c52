"""Dynamic speculative decoding's batch-size schedule: validation and the dense lookup, after
vLLM's ``test_dynamic_sd`` cases."""

from __future__ import annotations

import pytest

from shoal.engine.core.spec_schedule import build_spec_lookup, validate_spec_schedule


def test_valid_schedule_is_normalised_to_int_tuples_sorted_by_start() -> None:
    entries = [[65, 128, 1], (1, 64, 3), [129, 512, 0]]
    assert validate_spec_schedule(entries) == [(1, 64, 3), (65, 128, 1), (129, 512, 0)]
    assert validate_spec_schedule([[1, 1, 0]]) == [(1, 1, 0)]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([], "non-empty"),
        (None, "non-empty"),
        ("1,2,3", "non-empty"),
        ([(1, 16, 3), (32, 64)], r"\[start, end, K\].*\(32, 64\)"),
        ([(1, 16, 3, 4)], r"\[start, end, K\]"),
        ([5], r"\[start, end, K\]"),
        ([(1, 16.5, 3)], "integers.*16.5"),
        ([(0, 16, 3)], r"positive.*\(0, 16, 3\)"),
        ([(1, 16, 3), (17, -4, 1)], r"positive.*\(17, -4, 1\)"),
        ([(1, 16, 3), (20, 18, 1)], r"start must be <= end.*\(20, 18, 1\)"),
        ([(1, 16, -1)], r">= 0.*\(1, 16, -1\)"),
        ([(1, 16, 3), (16, 32, 2)], r"non-overlapping.*\[1, 16, 3\].*\[16, 32, 2\]"),
        ([(10, 20, 2), (1, 12, 3)], r"non-overlapping.*\[1, 12, 3\].*\[10, 20, 2\]"),
        ([(2, 16, 3)], r"must start at 1.*\[2, 16, 3\]"),
        ([(4, 8, 1), (2, 3, 2)], r"must start at 1.*\[2, 3, 2\]"),
    ],
)
def test_invalid_schedules_name_the_entry(entries: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_spec_schedule(entries)
    with pytest.raises(ValueError, match=message):
        build_spec_lookup(entries, 256, 3)


def test_lookup_uses_ranges_and_carries_gaps_and_tail_forward() -> None:
    lookup = build_spec_lookup([(1, 16, 3), (32, 128, 2), (256, 2048, 0)], 256, 3)
    assert len(lookup) == 257
    assert lookup[0] == 0
    assert lookup[1] == lookup[16] == 3
    assert lookup[17] == lookup[31] == 3  # gap keeps the previous K
    assert lookup[32] == lookup[128] == 2
    assert lookup[129] == lookup[255] == 2  # gap
    assert lookup[256] == 0
    with pytest.raises(IndexError):
        _ = lookup[257]


def test_tail_after_the_last_range_keeps_its_k() -> None:
    assert build_spec_lookup([(1, 2, 4), (3, 4, 1)], 8, 5) == [0, 4, 4, 1, 1, 1, 1, 1, 1]


def test_ranges_past_max_batch_size_are_cut_off() -> None:
    assert build_spec_lookup([(1, 2, 3), (3, 100, 1)], 4, 3) == [0, 3, 3, 1, 1]
    assert build_spec_lookup([(1, 2, 3), (6, 9, 0)], 4, 3) == [0, 3, 3, 3, 3]


def test_k_is_clamped_to_max_k() -> None:
    lookup = build_spec_lookup([(1, 256, 4)], 256, 3)
    assert lookup[1] == lookup[256] == 3
    assert build_spec_lookup([(1, 1, 5), (3, 3, 2)], 4, 3) == [0, 3, 3, 2, 2]


def test_lookup_rejects_non_positive_limits() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        build_spec_lookup([(1, 4, 2)], 0, 3)
    with pytest.raises(ValueError, match="max_k"):
        build_spec_lookup([(1, 4, 2)], 4, 0)
