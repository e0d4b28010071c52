"""verify_drafts: greedy drafts against the plain sampler run one position at a time (penalties,
min_tokens, logprobs), random rows against the processed target distribution (chi-square), seeded
requests independent of the batch, -1 drafts, and no drafts = the plain sampler."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from shoal.bus.messages.engine import Logprobs
from shoal.bus.messages.sampling import SamplingParams
from shoal.workers.sampler import Sampler
from shoal.workers.sampling_metadata import SamplingBatch
from shoal.workers.spec_decode.verify import Verified, verify_drafts
from tests.unit.test_sampler_metadata import sampling_batch

V = 24
EOS = 0
STOP = 5


@dataclass
class Req:
    params: SamplingParams
    prompt: list[int]
    output: list[int]
    rows: torch.Tensor  # [n + 1, V] target logits at its positions


def _batch(reqs: list[Req]) -> SamplingBatch:
    batch = sampling_batch(V)
    for i, r in enumerate(reqs):
        batch.requests.add(f"r{i}", r.params, r.prompt, list(r.output), eos_token_ids=[EOS])
    return batch


def _sequential(req: Req) -> tuple[list[int], list[Logprobs | None]]:
    """The plain sampler at each position alone, appending each token to the outputs."""
    batch = _batch([req])
    state = batch.requests["r0"]
    tokens: list[int] = []
    rows: list[Logprobs | None] = []
    for row in req.rows:
        out = Sampler()(row.unsqueeze(0).clone(), batch.prepare(["r0"]))
        tokens.append(int(out.sampled_token_ids[0]))
        state.output_token_ids.append(tokens[-1])
        rows.append(
            None if out.logprobs is None else out.logprobs.to_wire_rows([req.params.logprobs])[0]
        )
    return tokens, rows


def _verify(
    reqs: list[Req],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None] | None = None,
    ids: list[str] | None = None,
) -> Verified:
    batch = _batch(reqs)
    ids = ids or [f"r{i}" for i in range(len(reqs))]
    states = [batch.requests[r] for r in ids]
    logits = torch.cat([reqs[int(r[1:])].rows for r in ids])
    order = [drafts[int(r[1:])] for r in ids]
    probs = None if draft_probs is None else [draft_probs[int(r[1:])] for r in ids]
    return verify_drafts(logits.clone(), batch.prepare(ids), states, order, probs)


def _random_greedy_req(rng: random.Random, gen: torch.Generator, n: int) -> Req:
    params = SamplingParams(
        temperature=0.0,
        presence_penalty=rng.choice([0.0, 0.0, 1.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.9]),
        repetition_penalty=rng.choice([1.0, 1.0, 2.0, 0.5]),
        min_tokens=rng.choice([0, 0, 2, 4, 9]),
        stop_token_ids=[STOP],
        logprobs=rng.choice([None, 0, 3]),
        top_k=rng.choice([0, 3]),
    )
    output = [rng.randrange(V) for _ in range(rng.randrange(4))]
    rows = torch.randn(n + 1, V, generator=gen)
    # A few strong tokens that repeat, and often EOS/stop on top: penalties and min_tokens bite.
    rows[:, 1:4] += 2.5
    rows[:, [EOS, STOP]] += torch.rand(n + 1, 2, generator=gen) * 5
    return Req(params, [rng.randrange(V) for _ in range(3)], output, rows)


def _assert_logprobs_equal(got: Logprobs | None, want: list[Logprobs | None]) -> None:
    if want[0] is None:
        assert got is None
        return
    assert got is not None
    assert got.token_ids == [w.token_ids[0] for w in want if w is not None]
    assert got.ranks == [w.ranks[0] for w in want if w is not None]
    flat = [w.logprobs[0] for w in want if w is not None]
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(flat))


def _greedy_batch(seed: int) -> tuple[list[Req], list[tuple[list[int], list] | None]]:
    """1-4 random greedy requests; on odd seeds a random-sampling neighbour (expected None)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    reqs = [_random_greedy_req(rng, gen, rng.randrange(5)) for _ in range(rng.randrange(1, 5))]
    expected: list[tuple[list[int], list] | None] = [_sequential(r) for r in reqs]
    if seed % 2 == 0:
        return reqs, expected
    neighbour = SamplingParams(temperature=1.0, presence_penalty=1.0, min_tokens=2, logprobs=1)
    at = rng.randrange(len(reqs) + 1)
    reqs.insert(at, Req(neighbour, [1], [], torch.randn(3, V, generator=gen)))
    expected.insert(at, None)
    return reqs, expected


def _check_greedy(
    expected: list[tuple[list[int], list] | None], drafts: list[list[int]], verified: Verified
) -> None:
    """Each greedy request: the sequential tokens up to its first wrong draft, included."""
    for want, d, got, got_lp in zip(
        expected, drafts, verified.token_ids, verified.logprobs, strict=True
    ):
        if want is None:
            continue
        tokens, rows = want
        stop = next((k for k, t in enumerate(d) if t != tokens[k]), len(d))
        assert got == tokens[: stop + 1]
        _assert_logprobs_equal(got_lp, rows[: stop + 1])


@pytest.mark.parametrize("seed", range(12))
def test_greedy_drafts_match_the_plain_sampler_position_by_position(seed: int) -> None:
    reqs, expected = _greedy_batch(seed)
    rng = random.Random(seed)
    # The true continuation: every draft accepted, then the bonus token.
    drafts = [[4, 4] if want is None else want[0][:-1] for want in expected]
    verified = _verify(reqs, drafts)
    _check_greedy(expected, drafts, verified)
    for want, got in zip(expected, verified.token_ids, strict=True):
        assert want is None or got == want[0]
    # A wrong draft at a random position j.
    for d in drafts:
        if d:
            j = rng.randrange(len(d))
            d[j] = (d[j] + 1 + rng.randrange(V - 1)) % V
    _check_greedy(expected, drafts, _verify(reqs, drafts))


def test_penalties_count_the_earlier_drafts() -> None:
    """Token 7 leads at every position; with a big presence penalty the sequential sampler takes
    it once, so a draft repeating it must be rejected at the second position."""
    rows = torch.zeros(3, V)
    rows[:, 7] = 3.0
    rows[:, 8] = 2.0
    req = Req(SamplingParams(temperature=0.0, presence_penalty=2.0), [1], [], rows)
    assert _sequential(req)[0] == [7, 8, 7]
    assert _verify([req], [[7, 7]]).token_ids == [[7, 8]]


def test_min_tokens_masks_stop_ids_only_below_min_tokens() -> None:
    rows = torch.zeros(4, V)
    rows[:, EOS] = 5.0
    rows[:, 9] = 1.0
    req = Req(SamplingParams(temperature=0.0, min_tokens=3), [1], [4], rows)  # one output so far
    assert _verify([req], [[9, 9, EOS]]).token_ids == [[9, 9, EOS, EOS]]
    assert _verify([req], [[9, EOS, EOS]]).token_ids == [[9, 9]]


def test_no_drafts_is_the_plain_sampler() -> None:
    gen = torch.Generator().manual_seed(3)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, logprobs=2),
        SamplingParams(temperature=1.0, top_k=5, presence_penalty=0.5),
        SamplingParams(temperature=0.0, min_tokens=3, logprobs=1),
        SamplingParams(temperature=1.3, min_p=0.1),
    ]
    reqs = [Req(p, [1, 2], [3], torch.randn(1, V, generator=gen) * 2) for p in params]
    batch = _batch(reqs)
    ids = [f"r{i}" for i in range(len(reqs))]
    logits = torch.cat([r.rows for r in reqs])
    torch.manual_seed(0)
    plain = Sampler()(logits.clone(), batch.prepare(ids))
    assert plain.logprobs is not None
    torch.manual_seed(0)
    got = _verify(reqs, [[] for _ in reqs])
    assert got.token_ids == [[t] for t in plain.sampled_token_ids.tolist()]
    assert got.logprobs == plain.logprobs.to_wire_rows([p.logprobs for p in params])


def _processed_probs(row: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    keep = row.topk(top_k).indices
    masked = torch.full_like(row, float("-inf"))
    masked[keep] = row[keep] / temperature
    return torch.softmax(masked, dim=-1)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> float:
    support = probs > 0
    assert int(counts[~support].sum()) == 0  # nothing outside the processed support
    expected = probs[support] * draws
    return float(((counts[support] - expected) ** 2 / expected).sum())


CHI2_DF4_P001 = 18.467  # top_k = 5: 4 degrees of freedom


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_first_emitted_token_follows_the_processed_target(with_draft_probs: bool) -> None:
    """n-gram style: a fixed draft, p_draft = 1. With draft probs: drafts drawn from them."""
    gen = torch.Generator().manual_seed(5)
    row = torch.randn(2, V, generator=gen) * 1.5
    params = SamplingParams(temperature=0.7, top_k=5)
    p_target = _processed_probs(row[0], 0.7, 5)
    draws = 3000
    reqs = [Req(params, [1], [], row) for _ in range(draws)]
    q = torch.softmax(torch.randn(V, generator=gen), dim=-1)
    q[int(p_target.argsort()[-2])] += 1.0  # the draft favours a likely, not the likeliest, token
    q /= q.sum()
    if with_draft_probs:
        drafts = torch.multinomial(q, draws, replacement=True, generator=gen).tolist()
        probs: list[torch.Tensor | None] | None = [q.unsqueeze(0)] * draws
    else:
        drafts = [int(p_target.argsort()[-2])] * draws
        probs = None
    torch.manual_seed(1)
    got = _verify(reqs, [[d] for d in drafts], probs)
    first = torch.tensor([t[0] for t in got.token_ids])
    counts = torch.bincount(first, minlength=V).float()
    assert _chi_square(counts, p_target, draws) < CHI2_DF4_P001
    # Acceptance: min(1, p/q) per draft (p_draft = 1 without probs), so sum(min(p, q)) overall.
    rate = sum(len(t) == 2 for t in got.token_ids) / draws
    if with_draft_probs:
        expected_rate = float(torch.minimum(p_target, q).sum())
        assert abs(expected_rate - float((p_target * q).sum())) > 0.1  # p_draft = 1 would show
    else:
        expected_rate = float(p_target[drafts[0]])
    sigma = (expected_rate * (1 - expected_rate) / draws) ** 0.5
    assert abs(rate - expected_rate) < 4 * sigma


def test_seeded_request_does_not_depend_on_its_neighbours() -> None:
    gen = torch.Generator().manual_seed(8)
    x = Req(
        SamplingParams(temperature=1.0, seed=42), [1], [2], torch.randn(4, V, generator=gen) / 3
    )
    a = Req(SamplingParams(temperature=1.0), [1], [], torch.randn(2, V, generator=gen))
    b = Req(
        SamplingParams(temperature=0.5, seed=7, top_k=4), [3], [], torch.randn(3, V, generator=gen)
    )
    drafts = [[4, 5, 6], [1], [2, 3]]
    alone = _verify([x], drafts[:1]).token_ids[0]
    mixed = _verify([x, a, b], drafts, ids=["r2", "r1", "r0"]).token_ids
    assert mixed[2] == alone
    outcomes = {tuple(_verify([x], drafts[:1]).token_ids[0]) for _ in range(3)}
    assert outcomes == {tuple(alone)}
    seeds = [Req(SamplingParams(temperature=1.0, seed=s), [1], [2], x.rows) for s in range(5)]
    assert len({tuple(_verify([r], drafts[:1]).token_ids[0]) for r in seeds}) > 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_minus_one_draft_is_always_rejected(temperature: float, with_draft_probs: bool) -> None:
    rows = torch.zeros(3, V)
    rows[:, 6] = 50.0  # the target is certain of token 6 (-1 read as the last id: rejected)
    req = Req(SamplingParams(temperature=temperature), [1], [], rows)
    probs = [torch.full((2, V), 1.0 / V)] if with_draft_probs else None
    for _ in range(5):
        assert _verify([req], [[-1, 6]], probs).token_ids == [[6]]
    assert _verify([req], [[6, -1]], probs).token_ids == [[6, 6]]
    rows[:, V - 1] = 60.0  # now certain of the last id, which a -1 read from the end would be
    assert _verify([req], [[-1, V - 1]], probs).token_ids == [[V - 1]]
    rows[:, 0] = 70.0  # and of id 0, which a -1 clamped into the vocabulary would be
    assert _verify([req], [[-1, 0]], probs).token_ids == [[0]]


def test_mismatched_inputs_are_refused() -> None:
    req = Req(SamplingParams(temperature=0.0), [1], [], torch.zeros(2, V))
    with pytest.raises(ValueError):
        _verify([req], [[1, 2]])


def test_request_without_draft_probs_in_a_batch_with_some_keeps_its_verdicts() -> None:
    """p_draft = 1 for a request without probs, whether or not a neighbour brings some."""
    gen = torch.Generator().manual_seed(9)
    rows = torch.randn(3, V, generator=gen)
    rows[:, 2] += 1.0
    other = Req(SamplingParams(temperature=1.0), [1], [], torch.randn(2, V, generator=gen))
    q = torch.softmax(torch.randn(1, V, generator=gen), dim=-1)
    outcomes = []
    for seed in range(12):
        x = Req(SamplingParams(temperature=1.0, seed=seed), [1], [], rows)
        alone = _verify([x], [[2, 2]]).token_ids[0]
        mixed = _verify([x, other], [[2, 2], [4]], [None, q]).token_ids[0]
        assert mixed == alone
        outcomes.append(len(alone))
    assert len(set(outcomes)) > 1  # some drafts accepted, some rejected
