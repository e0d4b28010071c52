"""The n-gram (prompt-lookup) proposer: drafts the tokens that followed the latest suffix's
earlier occurrence, with vLLM's ``NgramProposer`` semantics.

For each request, the longest suffix n-gram with ``min_n <= n <= max_n`` that also occurs
earlier in the tokens (any window ending before the last token; ties go to the earliest
occurrence) proposes up to ``k`` of the tokens that followed it, capped by the end of the
context and by ``max_model_len - len(tokens)``. No match, or fewer than ``min_n`` tokens,
proposes nothing. Vectorised with numpy over the whole batch: O(batch * len * max_n)
element-wise work and no Python loop over positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.integer]


def _check_args(min_n: int, max_n: int, k: int) -> None:
    if min_n < 1 or max_n < min_n:
        raise ValueError(f"need 1 <= min_n <= max_n; got min_n={min_n}, max_n={max_n}")
    if k < 0:
        raise ValueError(f"k must be >= 0; got {k}")


def _match_lengths(rows: IntArray, lengths: IntArray, max_n: int) -> IntArray:
    """``[batch, width - 1]``: for each row and each window end ``j <= len - 2``, how many
    tokens (at most ``max_n``) ending at ``j`` equal the row's suffix; 0 elsewhere."""
    batch, width = rows.shape
    ends = np.arange(width - 1)
    alive = ends[None, :] <= (lengths[:, None] - 2)
    match = np.zeros((batch, width - 1), dtype=np.int32)
    body = rows[:, : width - 1]
    for d in range(max_n):
        suffix_pos = np.maximum(lengths - 1 - d, 0)
        suffix_tok = rows[np.arange(batch), suffix_pos]
        shifted = np.zeros_like(alive)
        if d < width - 1:
            shifted[:, d:] = body[:, : width - 1 - d] == suffix_tok[:, None]
        alive &= shifted
        if not alive.any():
            break
        match += alive
    return match


def propose_ngram_batch(
    token_rows: IntArray,
    lengths: Sequence[int] | IntArray,
    min_n: int,
    max_n: int,
    k: int,
    max_model_len: int,
) -> list[list[int]]:
    """Drafts for each row of ``token_rows`` (``[batch, width]``, row ``i`` valid up to
    ``lengths[i]``; the rest is ignored padding)."""
    _check_args(min_n, max_n, k)
    rows = np.asarray(token_rows)
    lens = np.asarray(lengths, dtype=np.int64)
    if rows.ndim != 2 or lens.shape != (rows.shape[0],):
        raise ValueError(f"need [batch, width] rows and [batch] lengths; got {rows.shape}")
    if (lens < 0).any() or (lens > rows.shape[1]).any():
        raise ValueError("lengths must lie in [0, width]")
    drafts: list[list[int]] = [[] for _ in range(rows.shape[0])]
    budgets = np.minimum(k, max_model_len - lens)
    # skip rows with no budget; rows shorter than min_n (or 2) could not match anyway
    todo = np.flatnonzero((lens >= min_n) & (budgets > 0) & (lens >= 2))
    if todo.size == 0 or rows.shape[1] < 2:
        return drafts
    match = _match_lengths(rows[todo], lens[todo], max_n)
    best = match.max(axis=1)
    first_end = np.argmax(match == best[:, None], axis=1)  # earliest occurrence wins
    for r, i in enumerate(todo):
        if best[r] < min_n:
            continue
        start = int(first_end[r]) + 1
        stop = min(start + int(budgets[i]), int(lens[i]))
        drafts[i] = [int(t) for t in rows[i, start:stop]]
    return drafts


def propose_ngram(
    tokens: IntArray, min_n: int, max_n: int, k: int, max_model_len: int
) -> list[int]:
    """The draft for one request's tokens (1-D), as :func:`propose_ngram_batch`."""
    row = np.asarray(tokens)
    if row.ndim != 1:
        raise ValueError(f"tokens must be 1-D; got shape {row.shape}")
    return propose_ngram_batch(row[None, :], [row.shape[0]], min_n, max_n, k, max_model_len)[0]
