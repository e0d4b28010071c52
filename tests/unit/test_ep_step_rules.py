"""The per-rank inputs of the DBO vote (``workers/moe/ep_step.py``): which steps are uniform
decodes, and which may be split (no request reads a KV block another request of the step
writes)."""

from __future__ import annotations

import numpy as np

from shoal.workers.input_batch import StepInputs
from shoal.workers.moe.ep_step import may_split, uniform_decode

BLOCK = 4


def step(
    num_computed: list[int], num_scheduled: list[int], tables: list[list[int]], drafts=None
) -> StepInputs:  # type: ignore[no-untyped-def]
    """A step whose requests hold ``tables`` (block ids) and write their scheduled tokens."""
    scheduled = np.array(num_scheduled, dtype=np.int64)
    computed = np.array(num_computed, dtype=np.int64)
    slots = [
        tables[i][p // BLOCK] * BLOCK + p % BLOCK
        for i in range(len(tables))
        for p in range(computed[i], computed[i] + scheduled[i])
    ]
    width = max(len(t) for t in tables)
    qsl = np.zeros(len(tables) + 1, dtype=np.int32)
    np.cumsum(scheduled, out=qsl[1:])
    return StepInputs(
        req_ids=[f"r{i}" for i in range(len(tables))],
        rows=np.arange(len(tables)),
        input_ids=np.zeros(len(slots), dtype=np.int64),
        positions=np.zeros(len(slots), dtype=np.int64),
        slot_mapping=np.array(slots, dtype=np.int64),
        block_tables=np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32),
        query_start_loc=qsl,
        seq_lens=(computed + scheduled).astype(np.int32),
        num_computed=computed,
        num_scheduled=scheduled,
        is_sampling=np.ones(len(tables), dtype=bool),
        max_query_len=int(scheduled.max()),
        max_seq_len=int((computed + scheduled).max()),
        num_drafts=np.array(drafts or [0] * len(tables), dtype=np.int64),
    )


def test_uniform_decode_is_one_query_of_one_token_plus_drafts_for_every_request() -> None:
    assert uniform_decode(step([5, 9], [1, 1], [[1, 2], [3, 4, 5]]))
    assert not uniform_decode(step([5, 0], [1, 4], [[1, 2], [3]]))  # a prefill among decodes
    assert uniform_decode(step([5, 9], [3, 3], [[1, 2], [3, 4, 5]], drafts=[2, 2]))
    assert not uniform_decode(step([5, 9], [3, 2], [[1, 2], [3, 4, 5]], drafts=[2, 1]))
    assert not uniform_decode(step([5, 9], [2, 2], [[1, 2], [3, 4, 5]]))  # 2-token chunks


def test_a_step_may_split_unless_a_request_reads_a_block_another_writes() -> None:
    assert may_split(step([5, 9], [1, 1], [[1, 2], [3, 4, 5]]), BLOCK)
    # r1 shares r0's first block, which r0 writes this step (a prefix hit on a block in flight)
    assert not may_split(step([0, 4], [4, 1], [[1], [1, 6]]), BLOCK)
    # sharing a block nobody writes this step (a landed prefix hit) is fine
    assert may_split(step([4, 4], [1, 1], [[1, 2], [1, 6]]), BLOCK)
