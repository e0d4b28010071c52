"""The batch-size → K table of dynamic speculative decoding (vLLM's dynamic SD schedule).

Owns two pure steps: validating the configured ``[[start, end, K], ...]`` ranges
(``num_speculative_tokens_per_batch_size``) and expanding them into a dense lookup the
scheduler indexes with the number of scheduled requests each step.
"""

from __future__ import annotations

from collections.abc import Sequence

SpecSchedule = list[tuple[int, int, int]]


def _parse_entry(entry: object) -> tuple[int, int, int]:
    """One ``(start, end, K)`` entry as ints, or ``ValueError`` naming the entry."""
    if isinstance(entry, str | bytes) or not isinstance(entry, Sequence) or len(entry) != 3:
        raise ValueError(f"each schedule entry must be [start, end, K]; got {entry!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in entry):
        raise ValueError(f"schedule entry values must be integers; got {entry!r}")
    start, end, k = (int(v) for v in entry)
    if start <= 0 or end <= 0:
        raise ValueError(f"batch-size bounds must be positive in {entry!r}")
    if start > end:
        raise ValueError(f"batch-size range start must be <= end in {entry!r}")
    if k < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0 in {entry!r}")
    return start, end, k


def validate_spec_schedule(entries: object) -> SpecSchedule:
    """The schedule as sorted ``(start, end, K)`` tuples; ``ValueError`` if it is invalid.

    Like vLLM's ``validate_and_normalize_dynamic_sd_schedule``: entries are sorted by start
    (normalisation), then must not overlap, and the first range must start at 1 so every
    runtime batch size has a K.
    """
    if isinstance(entries, str | bytes) or not isinstance(entries, Sequence) or not entries:
        raise ValueError(
            f"num_speculative_tokens_per_batch_size must be a non-empty list; got {entries!r}"
        )
    schedule = sorted((_parse_entry(e) for e in entries), key=lambda e: e[0])
    previous: tuple[int, int, int] | None = None
    for entry in schedule:
        if previous is not None and entry[0] <= previous[1]:
            raise ValueError(
                f"batch-size ranges must be sorted and non-overlapping: "
                f"{list(previous)!r} overlaps {list(entry)!r}"
            )
        previous = entry
    if schedule[0][0] != 1:
        raise ValueError(f"the first batch-size range must start at 1; got {list(schedule[0])!r}")
    return schedule


def build_spec_lookup(schedule: object, max_batch_size: int, max_k: int) -> list[int]:
    """A dense 1-indexed ``batch_size → K`` table of length ``max_batch_size + 1``.

    Index 0 is unused (0). Each K is clamped to ``max_k``; a gap between ranges and the tail
    after the last range carry the previous range's K forward; ranges past
    ``max_batch_size`` are cut off.
    """
    if max_batch_size <= 0:
        raise ValueError(f"max_batch_size must be > 0; got {max_batch_size}")
    if max_k <= 0:
        raise ValueError(f"max_k (num_speculative_tokens) must be > 0; got {max_k}")
    lookup = [0] * (max_batch_size + 1)
    last_k = 0
    next_bs = 1
    for start, end, k in validate_spec_schedule(schedule):
        if start > max_batch_size:
            break
        for bs in range(next_bs, start):  # a gap: the previous K carries forward
            lookup[bs] = last_k
        last_k = min(max_k, k)
        for bs in range(start, min(end, max_batch_size) + 1):
            lookup[bs] = last_k
        next_bs = min(end, max_batch_size) + 1
    for bs in range(next_bs, max_batch_size + 1):  # the tail keeps the last K
        lookup[bs] = last_k
    return lookup
