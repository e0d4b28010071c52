"""The n-gram proposer: vLLM's examples, longest-n and earliest-tie rules, the caps, and a
property against a brute-force reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.workers.spec_decode.ngram import propose_ngram, propose_ngram_batch


def reference(tokens: list[int], min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    """Brute force: longest n first, then the earliest earlier window equal to the suffix."""
    total = len(tokens)
    budget = min(k, max_model_len - total)
    if total < min_n or budget <= 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        for start in range(total - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + budget]
    return []


def ngram(tokens: list[int], min_n: int, max_n: int, k: int, max_len: int = 1000) -> list[int]:
    return propose_ngram(np.array(tokens, dtype=np.int64), min_n, max_n, k, max_len)


def test_vllm_examples() -> None:
    assert ngram([1, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1, 2]
    assert ngram([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2) == [6, 2]


def test_longest_n_wins_over_an_earlier_shorter_match() -> None:
    # suffix [7, 8, 9]: [9] occurs first at 0 (→ 5), [8, 9] only at 3 (→ 6)
    tokens = [9, 5, 1, 8, 9, 6, 2, 8, 9]
    assert ngram(tokens, 1, 3, 1) == [6]
    assert ngram(tokens, 1, 1, 1) == [5]


def test_match_longer_than_max_n_is_capped_and_earliest_kept() -> None:
    # suffix [3, 4, 5]: with max_n=2 only [4, 5] counts, at 0 (→ 1) and at 4 (→ 9): the
    # earliest wins; with max_n=3 the longer [3, 4, 5] at 3 (→ 9) wins
    tokens = [4, 5, 1, 3, 4, 5, 9, 3, 4, 5]
    assert ngram(tokens, 2, 2, 1) == [1]
    assert ngram(tokens, 2, 3, 1) == [9]


def test_ties_choose_the_earliest_occurrence() -> None:
    assert ngram([1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2], 2, 2, 1) == [10]


def test_overlapping_earlier_window_counts() -> None:
    assert ngram([1, 1, 1], 2, 2, 3) == [1]


def test_capped_by_context_end() -> None:
    assert ngram([1, 2, 3, 1, 2], 2, 2, 10) == [3, 1, 2]


def test_capped_by_max_model_len() -> None:
    assert ngram([1, 2, 3, 4, 1, 2], 2, 2, 3, max_len=8) == [3, 4]
    assert ngram([1, 2, 3, 4, 1, 2], 2, 2, 3, max_len=6) == []


def test_no_match_and_short_context() -> None:
    assert ngram([1, 2, 3, 4, 5], 1, 3, 3) == []
    assert ngram([1, 2, 1, 2], 3, 5, 3) == []  # only n=2 matches, below min_n
    assert ngram([7], 1, 1, 3) == []
    assert ngram([], 1, 1, 3) == []
    assert ngram([1, 2, 1], 1, 2, 0) == []


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="min_n"):
        ngram([1, 2], 0, 2, 1)
    with pytest.raises(ValueError, match="min_n"):
        ngram([1, 2], 3, 2, 1)
    with pytest.raises(ValueError, match="lengths"):
        propose_ngram_batch(np.zeros((2, 3), dtype=np.int64), [1, 4], 1, 1, 1, 10)


def test_batch_ignores_padding_past_each_length() -> None:
    rows = np.array([[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 5]], dtype=np.int64)
    # row 0 is [1, 2, 3, 1, 2] (its suffix read past the length would draft [2, 3]);
    # row 1 uses the whole width
    assert propose_ngram_batch(rows, [5, 7], 2, 2, 2, 100) == [[3, 1], [6, 5]]
    assert propose_ngram_batch(rows, [2, 0], 1, 2, 2, 100) == [[], []]


token_lists = st.lists(st.integers(0, 3), min_size=0, max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(token_lists, min_size=1, max_size=5),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
    k=st.integers(0, 6),
    max_len=st.integers(1, 50),
)
def test_matches_brute_force(
    rows: list[list[int]], min_n: int, extra: int, k: int, max_len: int
) -> None:
    max_n = min_n + extra
    width = max(len(r) for r in rows)
    padded = np.full((len(rows), width), 3, dtype=np.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    got = propose_ngram_batch(padded, [len(r) for r in rows], min_n, max_n, k, max_len)
    assert got == [reference(r, min_n, max_n, k, max_len) for r in rows]
    assert ngram(rows[0], min_n, max_n, k, max_len) == reference(rows[0], min_n, max_n, k, max_len)
