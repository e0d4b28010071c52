"""Speculative decoding in the model runner (n-gram drafts): outputs identical to the runner
without it and to transformers, with drafts accepted and rejected; the worker's own computed
counts under async scheduling's optimistic ones; padded drafts; seeded sampling; logprobs and
penalties.

Two tiny checkpoints: ``llama`` (its greedy outputs hardly ever repeat, so nearly every draft is
rejected: rollbacks) and ``markov``, the same with every attention and MLP output projection
zeroed, so each token depends on the previous one only: its outputs fall into loops within a few
tokens and most drafts are accepted.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import CachedRequestData, ExecuteStep, NewRequestData
from shoal.workers.input_batch import InputBatch
from shoal.workers.request_store import RequestStore
from shoal.workers.spec_decode.draft_model import DraftModelProposer
from shoal.workers.spec_decode.factory import make_proposer
from shoal.workers.spec_decode.ngram import propose_ngram
from shoal.workers.spec_decode.ngram_proposer import NgramProposer
from tests.fixtures.models import build_markov_checkpoint, make_prompts
from tests.golden.driver import greedy, make_runner
from tests.unit.spec_driver import SpecDriver

BLOCK = 4
MAX_TOKENS = 20
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


def _prompts() -> list[list[int]]:
    motif = make_prompts((5,), seed=7)[0]
    random = make_prompts((7, 15, 33), seed=3)
    return [motif * 4, *random, (motif + motif[:2]) * 3]


@pytest.fixture(scope="module", params=["llama", "markov"])
def model_dir(request, tiny_checkpoint, tmp_path_factory):  # type: ignore[no-untyped-def]
    if request.param == "markov":
        return build_markov_checkpoint(tmp_path_factory.mktemp("markov"))
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def spec_runner(model_dir):  # type: ignore[no-untyped-def]
    r = make_runner(model_dir, num_blocks=512, block_size=BLOCK, speculative_config=NGRAM)
    r.load()
    return r


@pytest.fixture(scope="module")
def plain_runner(model_dir):  # type: ignore[no-untyped-def]
    r = make_runner(model_dir, num_blocks=512, block_size=BLOCK)
    r.load()
    return r


def is_markov(model_dir: Path) -> bool:
    return "markov" in str(model_dir)


def drive(runner, params, k, **kwargs):  # type: ignore[no-untyped-def]
    prompts = _prompts()
    if not isinstance(params, list):
        params = [params] * len(prompts)
    return SpecDriver(runner, BLOCK).run(prompts, params, k=k, max_tokens=MAX_TOKENS, **kwargs)


@pytest.fixture(scope="module")
def baseline(plain_runner):  # type: ignore[no-untyped-def]
    return drive(plain_runner, greedy(MAX_TOKENS, logprobs=1), 0)


def test_baseline_matches_transformers(baseline, model_dir, hf_reference):
    assert baseline.outputs == hf_reference(model_dir, _prompts(), MAX_TOKENS)
    assert baseline.num_drafts == 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_ngram_drafts_equals_no_speculation(spec_runner, baseline, model_dir, k):
    run = drive(spec_runner, greedy(MAX_TOKENS, logprobs=1), k, first_chunk=9)
    assert run.outputs == baseline.outputs
    assert run.num_accepted < run.num_drafts  # some drafts rejected
    if is_markov(model_dir):  # most accepted
        assert run.num_accepted > run.num_drafts // 2
    for got, want in zip(run.logprobs, baseline.logprobs, strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-4)


@pytest.mark.parametrize(("optimistic", "extra"), [(True, 0), (True, 2), (False, 2)])
def test_optimistic_counts_and_padded_drafts(spec_runner, baseline, optimistic, extra):
    """Async scheduling: the engine core's counts run ahead by the last step's rejections, and
    it schedules drafts the worker never proposed (-1, always rejected)."""
    run = drive(spec_runner, greedy(MAX_TOKENS), 3, optimistic=optimistic, extra_drafts=extra)
    assert run.outputs == baseline.outputs
    assert run.num_accepted < run.num_drafts


def test_no_drafts_takes_the_plain_sampling_path(spec_runner, baseline, monkeypatch):
    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("verification ran in a step without drafts")

    monkeypatch.setattr(spec_runner.spec, "verify", refuse)
    run = drive(spec_runner, greedy(MAX_TOKENS), 0)
    assert run.outputs == baseline.outputs and run.num_drafts == 0


def test_seeded_sampling_is_reproducible(spec_runner):
    params = [
        SamplingParams(temperature=0.8, seed=11 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(len(_prompts()))
    ]
    first = drive(spec_runner, params, 3)
    second = drive(spec_runner, params, 3)
    assert first.outputs == second.outputs and first.num_drafts > 0


def test_penalties_with_drafts_equal_no_speculation(spec_runner, plain_runner):
    params = [
        greedy(MAX_TOKENS, repetition_penalty=1.3),
        greedy(MAX_TOKENS),
        greedy(MAX_TOKENS, repetition_penalty=1.2, frequency_penalty=0.4),
        greedy(MAX_TOKENS, presence_penalty=0.5),
        greedy(MAX_TOKENS, repetition_penalty=0.8),
    ]
    want = drive(plain_runner, params, 0)
    got = drive(spec_runner, params, 3)
    assert got.outputs == want.outputs and got.num_drafts > 0


def test_worker_count_behind_the_engine_core_is_refused(spec_runner):
    sp = greedy(4)
    spec_runner.execute(
        ExecuteStep(step_id=0, new_requests=[NewRequestData("x", [5, 6, 7], sp, [1], 0, 3)])
    )
    with pytest.raises(ValueError, match="fewer than the worker's"):
        spec_runner.execute(
            ExecuteStep(step_id=1, cached_requests=[CachedRequestData("x", [], 2, 1)])
        )
    spec_runner.execute(ExecuteStep(step_id=2, finished_req_ids=["x"]))


def test_ngram_proposer_over_batch_rows():
    batch = InputBatch(RequestStore(max_num_reqs=4, vocab_size=64), max_model_len=12,
                       block_size=4)  # fmt: skip
    rows = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7], [9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9]]
    for i, tokens in enumerate(rows):
        batch.add_request(f"r{i}", tokens, [], 0, greedy(4))
    proposer = NgramProposer(min_n=2, max_n=3, max_model_len=12)
    sampling_rows = np.array([batch.requests[f"r{i}"].row for i in (2, 0, 1)])
    drafts = proposer.propose(batch, None, sampling_rows, 3)  # type: ignore[arg-type]
    assert drafts.num_drafts.tolist() == [1, 3, 0]  # r2 is capped by max_model_len
    assert drafts.token_ids.tolist() == [[8, -1, -1], [4, 1, 2], [-1, -1, -1]]
    assert drafts.token_ids[1].tolist() == propose_ngram(np.array(rows[0]), 2, 3, 3, 12)
    assert drafts.probs is None


def test_make_proposer(model_dir):
    config = make_runner(
        model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2}
    ).config
    facts = dict(num_blocks=8, block_size=BLOCK, max_model_len=64, vocab_size=320,
                 device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
    proposer = make_proposer(config, **facts)  # type: ignore[arg-type]
    assert isinstance(proposer, NgramProposer) and (proposer.min_n, proposer.max_n) == (5, 5)
    draft = make_runner(
        model_dir, speculative_config={"model": str(model_dir), "num_speculative_tokens": 2}
    ).config
    assert isinstance(make_proposer(draft, **facts), DraftModelProposer)  # type: ignore[arg-type]


def test_drafts_extend_a_row_past_its_known_tokens():
    batch = InputBatch(RequestStore(max_num_reqs=2, vocab_size=64), max_model_len=16,
                       block_size=4)  # fmt: skip
    batch.add_request("a", [5, 6, 7], [1, 2], 2, greedy(4))
    batch.place_drafts(batch.requests["a"].row, [9, -1])
    inputs = batch.prepare_inputs(["a"], [3], [2])
    assert inputs.input_ids.tolist() == [7, 9, 0] and inputs.positions.tolist() == [2, 3, 4]
    assert inputs.is_sampling.tolist() == [True] and inputs.num_drafts.tolist() == [2]
    assert batch.num_tokens[batch.requests["a"].row] == 3  # drafts are not known tokens
    with pytest.raises(ValueError, match="not scheduled to their end"):
        batch.prepare_inputs(["a"], [2], [2])
    with pytest.raises(ValueError, match="past their known tokens"):
        batch.prepare_inputs(["a"], [4], [2])
    with pytest.raises(ValueError, match="exceed max_model_len"):
        batch.place_drafts(batch.requests["a"].row, [1] * 14)


def test_kept_draft_probs_are_padded_for_padded_drafts(spec_runner):
    spec = spec_runner.spec
    store = RequestStore(max_num_reqs=2, vocab_size=8)
    with_probs, without = store.add("p", greedy(4), [1]), store.add("q", greedy(4), [1])
    with_probs.spec_probs = torch.full((2, 8), 0.125)
    probs = spec._draft_probs([with_probs, without], [[3, 4, -1], [5]])
    assert probs[1] is None and probs[0].shape == (3, 8)
    assert probs[0][:2].sum().item() == pytest.approx(2.0) and probs[0][2].abs().sum() == 0
    assert spec._draft_probs([without], [[5]]) is None
