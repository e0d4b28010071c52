"""Sampler: greedy, seeded determinism across batch compositions, masks, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.bus.messages.sampling import SamplingParams
from shoal.workers.sampler import (
    Sampler,
    _apply_top_p_sorted,
    apply_top_k_top_p,
    compute_prompt_logprobs,
)
from shoal.workers.sampling_metadata import SamplingBatch
from tests.unit.test_sampler_metadata import sampling_batch

VOCAB = 32


def _batch(*requests: tuple[str, SamplingParams], vocab: int = VOCAB) -> SamplingBatch:
    batch = sampling_batch(vocab)
    for req_id, params in requests:
        batch.requests.add(req_id, params, prompt_token_ids=[1, 2, 3], eos_token_ids=[0])
    return batch


def _logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_equals_argmax() -> None:
    batch = _batch(*((f"r{i}", SamplingParams(temperature=0.0)) for i in range(5)))
    logits = _logits(5, seed=0)
    out = Sampler()(logits.clone(), batch.prepare([f"r{i}" for i in range(5)]))
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_greedy_rows_in_a_mixed_batch_take_the_argmax() -> None:
    batch = _batch(("g", SamplingParams(temperature=0.0)), ("r", SamplingParams(temperature=5.0)))
    logits = _logits(2, seed=1)
    for _ in range(10):
        out = Sampler()(logits.clone(), batch.prepare(["g", "r"]))
        assert out.sampled_token_ids[0].item() == logits[0].argmax().item()


def _run_seeded(order: list[str], others: dict[str, SamplingParams], steps: int) -> list[int]:
    """Tokens of request ``x`` (seed 7) over ``steps`` steps batched in ``order``."""
    params = {"x": SamplingParams(temperature=1.0, top_p=0.9, seed=7), **others}
    batch = _batch(*params.items())
    tokens = []
    for step in range(steps):
        logits = _logits(len(order), seed=1000 + step)
        logits[order.index("x")] = _logits(1, seed=step)[0]  # x sees the same logits each run
        out = Sampler()(logits, batch.prepare(order))
        token = int(out.sampled_token_ids[order.index("x")])
        batch.requests["x"].output_token_ids.append(token)
        tokens.append(token)
    return tokens


def test_seeded_request_gives_the_same_tokens_whatever_the_batch() -> None:
    alone = _run_seeded(["x"], {}, steps=6)
    others = {
        "a": SamplingParams(temperature=1.0),
        "b": SamplingParams(temperature=0.0),
        "c": SamplingParams(temperature=0.5, seed=99, top_k=3),
    }
    assert _run_seeded(["a", "x", "b", "c"], others, steps=6) == alone
    assert _run_seeded(["c", "b", "a", "x"], others, steps=6) == alone
    assert len(set(alone)) > 1  # really sampled, not greedy


def test_different_seeds_differ_and_unseeded_rows_vary() -> None:
    logits = _logits(1, seed=3).expand(2, VOCAB) / 10  # nearly flat: many likely tokens
    batch = _batch(("a", SamplingParams(seed=1)), ("b", SamplingParams(seed=2)))
    draws = [Sampler()(logits.clone(), batch.prepare(["a", "b"])).sampled_token_ids.tolist()]
    draws += [Sampler()(logits.clone(), batch.prepare(["a", "b"])).sampled_token_ids.tolist()]
    assert [d[0] for d in draws] != [d[1] for d in draws]


def test_preempted_seeded_request_resumes_its_generator() -> None:
    params = SamplingParams(seed=5)
    steps = [_logits(1, seed=s) / 4 for s in range(4)]
    straight = _batch(("x", params))
    expected = [int(Sampler()(t.clone(), straight.prepare(["x"])).sampled_token_ids) for t in steps]
    batch = _batch(("x", params))
    got = [int(Sampler()(steps[0].clone(), batch.prepare(["x"])).sampled_token_ids)]
    batch.requests.remove("x", preempted=True)
    batch.requests.add("x", params, [1, 2, 3], output_token_ids=got)
    got += [int(Sampler()(t.clone(), batch.prepare(["x"])).sampled_token_ids) for t in steps[1:]]
    assert got == expected


def _finite_set(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Tokens left sampleable: the sampler's masking, observed through many draws."""
    rows = 400
    torch.manual_seed(0)
    batch = _batch(*((f"r{i}", params) for i in range(rows)))
    out = Sampler()(
        logits.expand(rows, VOCAB).clone(), batch.prepare([f"r{i}" for i in range(rows)])
    )
    return set(out.sampled_token_ids.tolist())


def _probs(logits: torch.Tensor, temperature: float = 1.0) -> list[float]:
    values = [v / temperature for v in logits.tolist()]
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def _gapped_logits() -> torch.Tensor:
    """Distinct logits with clear gaps, so float rounding cannot move a mask edge."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4))
    return (torch.arange(VOCAB, dtype=torch.float32) * 0.25)[perm]


@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_top_k_keeps_only_the_k_best(top_k: int) -> None:
    logits = _gapped_logits()
    best = set(logits.topk(top_k).indices.tolist())
    seen = _finite_set(logits, SamplingParams(temperature=1.0, top_k=top_k))
    assert seen == best


@pytest.mark.parametrize("top_p", [0.2, 0.5, 0.8])
def test_top_p_keeps_the_smallest_nucleus(top_p: float) -> None:
    logits = _gapped_logits()
    probs = _probs(logits)
    nucleus, mass = set(), 0.0
    for token in sorted(range(VOCAB), key=lambda t: -probs[t]):
        if mass >= top_p:
            break
        nucleus.add(token)
        mass += probs[token]
    seen = _finite_set(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert seen == nucleus


def test_min_p_drops_tokens_below_the_scaled_top_probability() -> None:
    logits = _gapped_logits()
    probs = _probs(logits, temperature=2.0)
    allowed = {t for t in range(VOCAB) if probs[t] >= 0.3 * max(probs)}
    seen = _finite_set(logits, SamplingParams(temperature=2.0, min_p=0.3))
    assert seen == allowed
    assert 1 < len(allowed) < VOCAB


def test_top_k_and_top_p_together() -> None:
    logits = _gapped_logits()
    seen = _finite_set(logits, SamplingParams(temperature=1.0, top_k=5, top_p=0.99))
    assert seen == set(logits.topk(5).indices.tolist())


def test_temperature_sampling_follows_the_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    rows = 4000
    batch = sampling_batch(4)
    for i in range(rows):
        batch.requests.add(f"r{i}", SamplingParams(temperature=2.0), [0])
    out = Sampler()(logits.expand(rows, 4).clone(), batch.prepare([f"r{i}" for i in range(rows)]))
    counts = torch.bincount(out.sampled_token_ids, minlength=4).float() / rows
    for observed, expected in zip(counts.tolist(), _probs(logits[0], 2.0), strict=True):
        assert abs(observed - expected) < 0.03


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 0] = 5.0  # eos is best
    logits[0, 9] = 4.0  # then a stop id
    batch = sampling_batch(VOCAB)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9])
    batch.requests.add("r", params, [1], eos_token_ids=[0])
    assert int(Sampler()(logits.clone(), batch.prepare(["r"])).sampled_token_ids) not in (0, 9)
    batch.requests["r"].output_token_ids.append(4)
    assert int(Sampler()(logits.clone(), batch.prepare(["r"])).sampled_token_ids) not in (0, 9)
    batch.requests["r"].output_token_ids.append(4)
    assert int(Sampler()(logits.clone(), batch.prepare(["r"])).sampled_token_ids) == 0


def test_min_tokens_masks_eos_even_with_ignore_eos() -> None:
    """vLLM masks the model's eos below min_tokens whatever ignore_eos says."""
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 0], logits[0, 9], logits[0, 4] = 6.0, 5.0, 4.0  # eos, then a stop id, then 4
    batch = sampling_batch(VOCAB)
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[9], ignore_eos=True)
    batch.requests.add("r", params, [1], eos_token_ids=[0])
    assert int(Sampler()(logits.clone(), batch.prepare(["r"])).sampled_token_ids) == 4
    batch.requests["r"].output_token_ids.append(4)
    assert int(Sampler()(logits.clone(), batch.prepare(["r"])).sampled_token_ids) == 0


def test_logprobs_are_the_raw_log_softmax() -> None:
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.7, logprobs=2, repetition_penalty=1.5, top_k=4),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, logprobs=0, presence_penalty=1.0),
    ]
    batch = _batch(*((f"r{i}", p) for i, p in enumerate(params)))
    logits = _logits(4, seed=11)
    meta = batch.prepare([f"r{i}" for i in range(4)])
    out = Sampler()(logits.clone(), meta)
    assert out.logprobs is not None
    expected = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids.tolist()
    assert out.logprobs.token_ids[:, 0].tolist() == sampled
    for row in range(4):
        token_logprob = expected[row, sampled[row]]
        torch.testing.assert_close(out.logprobs.logprobs[row, 0], token_logprob)
        assert out.logprobs.ranks[row].item() == int((expected[row] >= token_logprob).sum())
        top = expected[row].topk(5)
        assert out.logprobs.token_ids[row, 1:].tolist() == top.indices.tolist()
        torch.testing.assert_close(out.logprobs.logprobs[row, 1:], top.values)
    assert out.logprobs.ranks[0].item() == 1  # greedy picks the most likely token
    wire = out.logprobs.to_wire_rows(meta.num_logprobs)
    assert wire[2] is None
    assert [len(w.token_ids[0]) for w in wire if w is not None] == [6, 3, 1]


def test_prompt_logprobs_gather_the_next_prompt_tokens() -> None:
    logits = _logits(5, seed=12)  # positions 0..4 of a prompt
    next_tokens = torch.tensor([3, 1, 4, 1, 5])
    result = compute_prompt_logprobs(logits.clone(), next_tokens, num_logprobs=2).to_wire()
    expected = torch.log_softmax(logits, dim=-1)
    assert [row[0] for row in result.token_ids] == next_tokens.tolist()
    for pos, token in enumerate(next_tokens.tolist()):
        assert result.logprobs[pos][0] == pytest.approx(expected[pos, token].item(), abs=1e-6)
        assert result.token_ids[pos][1:] == expected[pos].topk(2).indices.tolist()
        assert result.ranks[pos] == int((expected[pos] >= expected[pos, token]).sum())


def test_wrong_logits_shape_is_refused() -> None:
    batch = _batch(("a", SamplingParams()))
    with pytest.raises(ValueError, match="num_reqs=1"):
        Sampler()(torch.zeros(2, VOCAB), batch.prepare(["a"]))


@pytest.mark.parametrize("scale", [0.05, 4.0])  # flat (nucleus > 256 tokens: sort) and peaked
def test_top_p_paths_agree_with_the_reference(scale: float) -> None:
    vocab, top_p = 1000, 0.7
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5)) * scale
    masked = logits.clone()
    apply_top_k_top_p(masked, None, 0, torch.full((3,), top_p))
    sorted_path = logits.clone()
    _apply_top_p_sorted(sorted_path, torch.full((3,), top_p))
    for row in range(3):
        probs = torch.softmax(logits[row].double(), dim=-1).tolist()
        nucleus, mass = set(), 0.0
        for token in sorted(range(vocab), key=lambda t: -probs[t]):
            if mass >= top_p:
                break
            nucleus.add(token)
            mass += probs[token]
        assert set(torch.isfinite(masked[row]).nonzero().flatten().tolist()) == nucleus
        assert set(torch.isfinite(sorted_path[row]).nonzero().flatten().tolist()) == nucleus
