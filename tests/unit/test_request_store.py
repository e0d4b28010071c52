"""The worker's one store of per-request state, read by the batch arrays and the sampling
metadata builder: what is added or removed there is seen by both."""

from __future__ import annotations

import pytest

from shoal.bus.messages.sampling import SamplingParams
from shoal.workers.input_batch import InputBatch
from shoal.workers.request_store import RequestStore
from shoal.workers.sampling_metadata import SamplingBatch

VOCAB = 64
GREEDY = SamplingParams(temperature=0.0)


def make() -> tuple[RequestStore, InputBatch, SamplingBatch]:
    requests = RequestStore(max_num_reqs=3, vocab_size=VOCAB)
    return (
        requests,
        InputBatch(requests, max_model_len=32, block_size=4),
        SamplingBatch(requests),
    )


def test_a_request_added_or_removed_once_is_seen_by_both_readers() -> None:
    requests, batch, sampling = make()
    state = batch.add_request("a", [1, 2, 3], [1], 0, GREEDY, output_token_ids=[7])
    batch.add_request("b", [4, 5], [2], 0, SamplingParams(temperature=0.5))
    assert requests["a"] is state and state.num_prompt_tokens == 3
    assert batch.token_ids[state.row, :4].tolist() == [1, 2, 3, 7]
    assert sampling.prepare(["a", "b"]).is_greedy.tolist() == [True, False]
    row = state.row
    assert batch.remove_request("a")
    assert "a" not in batch and "a" not in requests and len(requests) == 1
    with pytest.raises(KeyError):
        batch.prepare_inputs(["a"], [1])
    with pytest.raises(KeyError):
        sampling.prepare(["a", "b"])
    assert batch.add_request("c", [9], [3], 0, GREEDY).row == row  # the freed row is reused
    assert sampling.prepare(["c", "b"]).num_reqs == 2


def test_a_request_replaced_under_the_same_rows_rebuilds_the_metadata() -> None:
    """Rows equal to the previous step's reuse the metadata only while no request came or went."""
    _, batch, sampling = make()
    batch.add_request("a", [1, 2], [1], 0, GREEDY)
    greedy = sampling.prepare(["a"])
    assert sampling.prepare(["a"]) is greedy
    batch.remove_request("a")
    batch.add_request("a", [1, 2], [1], 0, SamplingParams(temperature=0.7, seed=3))
    replaced = sampling.prepare(["a"])
    assert replaced is not greedy
    assert replaced.is_greedy.tolist() == [False] and set(replaced.generators) == {0}


def test_a_preempted_seeded_request_gets_its_generator_back() -> None:
    requests, batch, _ = make()
    params = SamplingParams(temperature=1.0, seed=11)
    generator = batch.add_request("x", [1, 2], [1], 0, params).generator
    assert generator is not None
    generator.manual_seed(99)  # stands for draws made before the preemption
    state_before = generator.get_state()
    batch.remove_request("x", preempted=True)
    assert "x" not in requests
    resumed = batch.add_request("x", [1, 2], [1], 0, params, output_token_ids=[5], resumed=True)
    assert resumed.generator is generator and resumed.resumed
    assert resumed.generator.get_state().equal(state_before)
    batch.remove_request("x")  # finished: nothing is kept for it
    assert batch.add_request("x", [1, 2], [1], 0, params).generator is not generator


def test_stop_ids_and_a_full_batch() -> None:
    _, batch, _ = make()
    stops = SamplingParams(stop_token_ids=[3, VOCAB + 1])  # EOS first, deduped, in vocabulary
    a = batch.add_request("a", [1], [1], 0, stops, eos_token_ids=[2, 3])
    ignoring = SamplingParams(stop_token_ids=[4], ignore_eos=True)
    b = batch.add_request("b", [1], [1], 0, ignoring, eos_token_ids=[2])
    assert (a.stop_token_ids, b.stop_token_ids) == ([2, 3], [2, 4])  # min_tokens masks eos anyway
    batch.add_request("c", [1], [1], 0, GREEDY)
    with pytest.raises(RuntimeError, match="full"):
        batch.add_request("d", [1], [1], 0, GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        batch.add_request("c", list(range(33)), [1], 0, GREEDY)
