"""The persistent batch: flat step inputs from per-request state, row reuse, block growth."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.bus.messages.sampling import SamplingParams
from shoal.workers.input_batch import InputBatch
from shoal.workers.kv_cache import bytes_per_block, num_blocks_for_budget
from shoal.workers.request_store import RequestStore

P = SamplingParams(temperature=0.0)


def make_batch() -> InputBatch:
    requests = RequestStore(max_num_reqs=4, vocab_size=128)
    return InputBatch(requests, max_model_len=64, block_size=4)


def test_mixed_prefill_chunk_and_decode_inputs():
    batch = make_batch()
    batch.add_request("a", list(range(100, 110)), [7, 3, 9], 4, P)  # chunk of 10-token prompt
    batch.add_request("b", [5, 6, 7, 8, 9], [2, 4], 5, P)
    batch.append_token(np.array([batch.requests["b"].row]), np.array([42]))  # b decoded 42
    inputs = batch.prepare_inputs(["a", "b"], [5, 1])
    assert inputs.input_ids.tolist() == [104, 105, 106, 107, 108, 42]
    assert inputs.positions.tolist() == [4, 5, 6, 7, 8, 5]
    # a: positions 4..7 in block 3 (table slot 1), position 8 in block 9; b: position 5 in block 4
    assert inputs.slot_mapping.tolist() == [12, 13, 14, 15, 36, 17]
    assert inputs.query_start_loc.tolist() == [0, 5, 6]
    assert inputs.seq_lens.tolist() == [9, 6]
    assert inputs.block_tables.tolist() == [[7, 3, 9], [2, 4, 0]]
    assert inputs.is_sampling.tolist() == [False, True]
    assert (inputs.max_query_len, inputs.max_seq_len) == (5, 9)
    batch.advance(inputs)
    assert batch.num_computed[batch.requests["a"].row] == 9


def test_rows_are_reused_and_state_reset():
    batch = make_batch()
    for i in range(4):
        batch.add_request(f"r{i}", [1, 2, 3], [1], 0, P)
    with pytest.raises(RuntimeError, match="full"):
        batch.add_request("r4", [1], [1], 0, P)
    row = batch.requests["r2"].row
    assert batch.remove_request("r2") and not batch.remove_request("r2")
    batch.add_request("r5", [9, 8], [5], 0, P)
    assert batch.requests["r5"].row == row
    assert batch.prepare_inputs(["r5"], [2]).input_ids.tolist() == [9, 8]


def test_block_growth_and_missing_block():
    batch = make_batch()
    batch.add_request("a", [1, 2, 3, 4], [6], 0, P)
    batch.prepare_inputs(["a"], [4])
    batch.num_computed[batch.requests["a"].row] = 4
    batch.append_token(np.array([batch.requests["a"].row]), np.array([11]))
    with pytest.raises(ValueError, match="no KV block"):
        batch.prepare_inputs(["a"], [1])
    batch.append_blocks(batch.requests["a"].row, [8])
    assert batch.prepare_inputs(["a"], [1]).slot_mapping.tolist() == [32]


def test_scheduling_past_known_tokens_is_refused():
    batch = make_batch()
    batch.add_request("a", [1, 2, 3], [1], 0, P)
    with pytest.raises(ValueError, match="past their known tokens"):
        batch.prepare_inputs(["a"], [4])


def test_kv_budget_sizing():
    per_block = bytes_per_block(
        num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32
    )
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4
    assert num_blocks_for_budget(10 * per_block + 5, per_block) == 10
    with pytest.raises(ValueError, match="at least 2"):
        num_blocks_for_budget(per_block, per_block)
