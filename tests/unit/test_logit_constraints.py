"""logit_bias and allowed_token_ids in the sampler and the spec-decode verifier, on crafted
logits: what greedy and sampled rows may pick, vLLM V1's order (allowed mask, min_tokens, bias,
penalties), rows without them untouched bit for bit, and drafts verified as the plain sampler."""

from __future__ import annotations

import random

import pytest
import torch

from shoal.bus.messages.sampling import SamplingParams, out_of_vocab
from shoal.workers.sampler import Sampler, compute_logprobs
from shoal.workers.sampling_metadata import SamplingBatch
from tests.unit.test_sampler_metadata import sampling_batch
from tests.unit.test_spec_verify import Req, V, _check_greedy, _sequential, _verify

VOCAB = 32
ALLOWED = [3, 11, 17, 29]


def _batch(*params: SamplingParams, vocab: int = VOCAB) -> tuple[SamplingBatch, list[str]]:
    batch = sampling_batch(vocab)
    ids = [f"r{i}" for i in range(len(params))]
    for req_id, p in zip(ids, params, strict=True):
        batch.requests.add(req_id, p, prompt_token_ids=[1, 2, 3], eos_token_ids=[0])
    return batch, ids


def _logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)  # type: ignore[arg-type]


def test_a_bias_of_plus_100_is_picked_and_minus_100_is_banned() -> None:
    logits = _logits(2, seed=0)
    top = int(logits[1].argmax())
    second = int(logits[1].topk(2).indices[1])
    batch, ids = _batch(_greedy(logit_bias={7: 100.0}), _greedy(logit_bias={top: -100.0}))
    out = Sampler()(logits.clone(), batch.prepare(ids))
    assert out.sampled_token_ids.tolist() == [7, second]


def test_the_bias_is_added_to_the_logit() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 1.0
    batch, ids = _batch(_greedy(logit_bias={5: 0.5, 6: 1.5}))
    processed = logits.clone()
    Sampler()(processed, batch.prepare(ids))  # fp32 logits are processed in place
    want = logits.clone()
    want[0, 5] += 0.5
    want[0, 6] += 1.5
    assert torch.equal(processed, want)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 5.0])
def test_allowed_token_ids_restrict_greedy_and_sampled_rows(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, allowed_token_ids=ALLOWED)
    batch, ids = _batch(params, params)
    seen: set[int] = set()
    for step in range(200 if temperature else 5):
        logits = _logits(2, seed=step)
        logits[:, 5] = 50.0  # far ahead of every allowed token
        seen |= set(Sampler()(logits, batch.prepare(ids)).sampled_token_ids.tolist())
    assert seen <= set(ALLOWED)
    assert len(seen) > 1 or temperature == 0.0  # a hot sampler does use the allowed set


def test_rows_without_them_are_untouched_in_a_mixed_batch() -> None:
    """Bias, allowed ids, both, none: each constrained row as alone, the others bit for bit."""
    params = [
        _greedy(),
        _greedy(logit_bias={2: 30.0, 9: -5.0}),
        _greedy(),
        _greedy(allowed_token_ids=ALLOWED),
        _greedy(allowed_token_ids=ALLOWED, logit_bias={17: 40.0, 3: 2.0}),
        _greedy(),
    ]
    logits = _logits(len(params), seed=3)
    logits[3:5, 5] = 50.0  # the raw argmax of the restricted rows, not allowed
    batch, ids = _batch(*params)
    mixed = logits.clone()
    out = Sampler()(mixed, batch.prepare(ids))
    for row in (0, 2, 5):
        assert torch.equal(mixed[row], logits[row])
    for row in (1, 3, 4):
        alone_batch, alone_ids = _batch(params[row])
        alone = logits[row : row + 1].clone()
        want = Sampler()(alone, alone_batch.prepare(alone_ids)).sampled_token_ids
        assert torch.equal(mixed[row], alone[0]) and out.sampled_token_ids[row] == want[0]
    assert out.sampled_token_ids.tolist()[:3] == [
        int(logits[0].argmax()),
        2,
        int(logits[2].argmax()),
    ]
    assert out.sampled_token_ids[3] in ALLOWED and out.sampled_token_ids[4] == 17


def test_every_row_restricted_and_the_cached_metadata_keeps_them() -> None:
    batch, ids = _batch(_greedy(allowed_token_ids=[4]), _greedy(allowed_token_ids=[8, 9]))
    for step in range(3):  # steps after the first reuse the cached metadata
        out = Sampler()(_logits(2, seed=step), batch.prepare(ids))
        assert out.sampled_token_ids[0] == 4 and out.sampled_token_ids[1] in (8, 9)
        for req_id, token in zip(ids, out.sampled_token_ids.tolist(), strict=True):
            batch.requests[req_id].output_token_ids.append(token)


def test_the_bias_comes_before_penalties_and_the_mask_before_min_tokens() -> None:
    """Token 1 (in the prompt, logit 1) biased +1 then divided by repetition 2 gives 1.0, below
    token 10's 1.2 (the other order would give 1.5). Allowed {0 (EOS), 12} with min_tokens
    masking EOS leaves 12."""
    logits = torch.zeros(2, VOCAB)
    logits[0, 1], logits[0, 10] = 1.0, 1.2
    logits[1, 0], logits[1, 5] = 9.0, 8.0
    batch, ids = _batch(
        _greedy(logit_bias={1: 1.0}, repetition_penalty=2.0),
        _greedy(allowed_token_ids=[0, 12], min_tokens=2),
    )
    assert Sampler()(logits, batch.prepare(ids)).sampled_token_ids.tolist() == [10, 12]


def test_logprobs_stay_the_raw_model_distribution() -> None:
    logits = _logits(1, seed=5)
    batch, ids = _batch(_greedy(allowed_token_ids=ALLOWED, logit_bias={3: 9.0}, logprobs=2))
    out = Sampler()(logits.clone(), batch.prepare(ids))
    assert out.logprobs is not None and out.sampled_token_ids[0] == 3
    torch.testing.assert_close(out.logprobs.logprobs[0, 0], compute_logprobs(logits)[0, 3])


def test_ids_beyond_the_vocabulary_are_named() -> None:
    assert out_of_vocab(SamplingParams(logit_bias={31: 1.0}), VOCAB) is None
    assert out_of_vocab(SamplingParams(logit_bias={32: 1.0}), VOCAB)[0] == "logit_bias"  # type: ignore[index]
    bad = out_of_vocab(SamplingParams(allowed_token_ids=[1, 40]), VOCAB)
    assert bad is not None and bad[0] == "allowed_token_ids" and "40" in bad[1]


# ----- the spec-decode verifier processes each draft row as the plain sampler would


def _constrained_req(rng: random.Random, gen: torch.Generator, n: int) -> Req:
    allowed = rng.choice([None, sorted(rng.sample(range(V), 4))])
    bias = rng.choice([None, {rng.randrange(V): rng.choice([-100.0, 3.0, 100.0])}])
    params = SamplingParams(
        temperature=0.0,
        allowed_token_ids=allowed,
        logit_bias=bias,
        presence_penalty=rng.choice([0.0, 1.5]),
        logprobs=rng.choice([None, 2]),
    )
    output = [rng.randrange(V) for _ in range(rng.randrange(3))]
    return Req(params, [1, 2], output, torch.randn(n + 1, V, generator=gen) * 2)


@pytest.mark.parametrize("seed", range(10))
def test_greedy_drafts_obey_them_as_the_plain_sampler(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    reqs = [_constrained_req(rng, gen, rng.randrange(4)) for _ in range(rng.randrange(1, 5))]
    expected = [_sequential(r) for r in reqs]
    drafts = [list(tokens[:-1]) for tokens, _ in expected]  # the true continuation
    verified = _verify(reqs, drafts)
    assert verified.token_ids == [tokens for tokens, _ in expected]
    for d in drafts:  # a wrong draft somewhere
        if d:
            j = rng.randrange(len(d))
            d[j] = (d[j] + 1 + rng.randrange(V - 1)) % V
    _check_greedy(list(expected), drafts, _verify(reqs, drafts))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_outside_the_allowed_set_are_rejected(temperature: float) -> None:
    rows = torch.zeros(4, V)
    rows[:, 6] = 20.0  # the raw argmax, not allowed
    params = SamplingParams(temperature=temperature, allowed_token_ids=[2, 3])
    for _ in range(20):
        got = _verify([Req(params, [1], [], rows.clone())], [[6, 6, 6]]).token_ids
        assert len(got[0]) == 1 and got[0][0] in (2, 3)


def test_draft_rows_get_the_bias() -> None:
    rows = torch.zeros(3, V)
    rows[:, 6] = 5.0
    req = Req(SamplingParams(temperature=0.0, logit_bias={6: -100.0, 9: 100.0}), [1], [], rows)
    assert _verify([req], [[9, 9]]).token_ids == [[9, 9, 9]]
    assert _verify([req], [[6, 9]]).token_ids == [[9]]
