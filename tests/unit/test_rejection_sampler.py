"""Rejection sampler: greedy runs and bonus tokens, -1 drafts, seeded rows, and a chi-square
check that the first emitted token of a random row is distributed as the target's."""

from __future__ import annotations

import pytest
import torch

from shoal.workers.spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    parse_output,
    rejection_sample,
)

V = 5
P_TARGET = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15])
P_DRAFT = torch.tensor([0.30, 0.10, 0.40, 0.10, 0.10])
CHI2_DF4_P001 = 18.467  # chi-square critical value, 4 degrees of freedom, alpha = 0.001


def _one_hot_probs(argmaxes: list[int]) -> torch.Tensor:
    probs = torch.full((len(argmaxes), V), 0.1 / (V - 1))
    probs[torch.arange(len(argmaxes)), torch.tensor(argmaxes, dtype=torch.int64)] = 0.9
    return probs


def _greedy(
    argmaxes: list[int], drafts: list[int], counts: list[int], bonus: list[int]
) -> torch.Tensor:
    return rejection_sample(
        _one_hot_probs(argmaxes),
        torch.tensor(drafts, dtype=torch.int64),
        counts,
        torch.tensor(bonus),
        [True] * len(counts),
    )


def test_greedy_all_accepted_appends_bonus() -> None:
    out = _greedy([1, 2, 3], [1, 2, 3], [3], [4])
    assert out.tolist() == [[1, 2, 3, 4]]
    assert out.dtype == torch.int64


def test_greedy_first_mismatch_emits_target_token_and_stops() -> None:
    out = _greedy([1, 2, 3], [1, 0, 3], [3], [4])
    assert out.tolist() == [[1, 2, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID]]


def test_greedy_mismatch_at_position_zero() -> None:
    assert _greedy([1, 2], [0, 2], [2], [4]).tolist() == [[1, -1, -1]]


def test_zero_drafts_emit_only_the_bonus() -> None:
    out = _greedy([1, 2], [1, 0], [0, 2, 0], [3, 4, 0])
    assert out.tolist() == [[3, -1, -1], [1, 2, -1], [0, -1, -1]]
    assert parse_output(out) == [[3], [1, 2], [0]]


def test_all_rows_without_drafts() -> None:
    out = rejection_sample(
        torch.empty(0, V),
        torch.empty(0, dtype=torch.int64),
        [0, 0],
        torch.tensor([2, 3]),
        [False, True],
    )
    assert out.tolist() == [[2], [3]]


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_minus_one_draft_is_always_rejected(greedy: bool, with_draft_probs: bool) -> None:
    target = torch.zeros(2, V)
    target[:, 0] = 1.0  # all mass on token 0; draft probs equal the target's
    out = rejection_sample(
        target,
        torch.tensor([-1, 0]),
        [2],
        torch.tensor([4]),
        [greedy],
        draft_probs=target.clone() if with_draft_probs else None,
    )
    assert out.tolist() == [[0, -1, -1]]


def test_random_row_accepts_drafts_the_target_certainly_makes() -> None:
    target = torch.zeros(3, V)
    target[torch.arange(3), torch.tensor([2, 4, 1])] = 1.0
    out = rejection_sample(target, torch.tensor([2, 4, 1]), [3], torch.tensor([3]), [False])
    assert parse_output(out) == [[2, 4, 1, 3]]


def _random_batch(rows: int, gen_seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(gen_seed)
    target = torch.softmax(torch.randn(rows * 3, V, generator=gen), dim=-1)
    draft_probs = torch.softmax(torch.randn(rows * 3, V, generator=gen), dim=-1)
    drafts = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)
    return target, draft_probs, drafts


def _seeded_run(other_seed: int, seed: int) -> list[int]:
    """Row 1 seeded; rows 0 and 2 differ with ``other_seed``; returns row 1's tokens."""
    target, draft_probs, drafts = _random_batch(3, 0)
    other_target, other_draft, other_ids = _random_batch(3, other_seed)
    row1 = slice(3, 6)
    other_target[row1], other_draft[row1], other_ids[row1] = (
        target[row1],
        draft_probs[row1],
        drafts[row1],
    )
    gens = {1: torch.Generator().manual_seed(seed)}
    out = rejection_sample(
        other_target, other_ids, [3, 3, 3], torch.tensor([0, 1, 2]), [False] * 3, other_draft, gens
    )
    return out[1].tolist()


def test_seeded_row_is_reproducible_and_independent_of_other_rows() -> None:
    torch.manual_seed(123)
    first = _seeded_run(other_seed=1, seed=7)
    torch.manual_seed(456)
    assert _seeded_run(other_seed=2, seed=7) == first
    # The seed matters: some seed gives the row a different output.
    assert any(_seeded_run(other_seed=1, seed=s) != first for s in range(8, 40))


def _chi_square(samples: torch.Tensor, expected: torch.Tensor) -> float:
    observed = torch.bincount(samples, minlength=V).double()
    exp = expected.double() * samples.numel()
    return float(((observed - exp) ** 2 / exp).sum())


@pytest.mark.parametrize("drafts_from", ["draft_probs", "ngram", "invalid"])
def test_first_token_is_distributed_as_the_target(drafts_from: str) -> None:
    rows = 20_000
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    target = P_TARGET.expand(rows, V).contiguous()
    draft_probs: torch.Tensor | None = None
    if drafts_from == "draft_probs":
        draft_probs = P_DRAFT.expand(rows, V).contiguous()
        drafts = torch.multinomial(P_DRAFT, rows, replacement=True, generator=gen)
    else:  # n-gram style (draft prob 1): a fixed draft, or -1 (always rejected)
        drafts = torch.full((rows,), 1 if drafts_from == "ngram" else -1, dtype=torch.int64)
    out = rejection_sample(
        target,
        drafts,
        [1] * rows,
        torch.zeros(rows, dtype=torch.int64),
        [False] * rows,
        draft_probs,
    )
    assert (out[:, 0] >= 0).all()
    assert _chi_square(out[:, 0], P_TARGET) < CHI2_DF4_P001


def test_parse_output_drops_placeholders_and_out_of_vocab_ids() -> None:
    out = torch.tensor([[3, 9, -1], [-1, -1, -1]])
    assert parse_output(out) == [[3, 9], []]
    assert parse_output(out, vocab_size=5) == [[3], []]


def test_random_row_stops_at_first_rejection_with_a_recovered_token() -> None:
    target = torch.zeros(3, V)
    target[torch.arange(3), torch.tensor([2, 3, 1])] = 1.0  # draft 4 at position 1 is impossible
    drafts = torch.tensor([2, 4, 1])
    out = rejection_sample(
        target, drafts, [3], torch.tensor([0]), [False], draft_probs=target.clone()
    )
    assert out.tolist() == [[2, 3, -1, -1]]


def test_mixed_batch_greedy_and_random_rows() -> None:
    target = torch.zeros(4, V)
    target[torch.arange(4), torch.tensor([1, 2, 3, 4])] = 1.0
    target[0, 1:3] = torch.tensor([0.6, 0.4])  # a random row would always accept draft 2 here
    drafts = torch.tensor([2, 2, 3, 4])  # row 0 (greedy) mismatches at 0; row 1 (random) accepts
    out = rejection_sample(
        target, drafts, [2, 2], torch.tensor([0, 2]), torch.tensor([True, False]), target.clone()
    )
    assert parse_output(out) == [[1], [3, 4, 2]]
