"""The batch-size → K table of dynamic speculative decoding (vLLM's dynamic SD schedule).

Expands the configured ``[[start, end, K], ...]`` ranges (``num_speculative_tokens_per_batch_size``,
validated by ``config.speculative.validate_spec_schedule``) into a dense lookup the
scheduler indexes with the number of scheduled requests each step.
"""

from __future__ import annotations

from shoal.config.speculative import SpecSchedule, validate_spec_schedule


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


__all__ = ["SpecSchedule", "build_spec_lookup", "validate_spec_schedule"]
