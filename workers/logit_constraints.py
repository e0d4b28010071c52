"""vLLM's ``allowed_token_ids`` and ``logit_bias``, batched: built once per batch composition
(they depend on the requests' parameters only, never on their outputs) and applied to the
logits before min_tokens and penalties: the allowed-token mask first, the bias after min_tokens
(vLLM V1's order: allowed mask, min_tokens, logit bias, penalties).

Only the rows that use them are touched: one masked fill over the allowed rows and one sparse
``index_put_`` of the bias entries per step. The speculative verifier repeats each request's
rows over its drafts and bonus row with ``expand`` (tensor ops, no Python loop over entries).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shoal.bus.messages.sampling import SamplingParams

Move = Callable[[torch.Tensor], torch.Tensor]  # a CPU tensor to the sampler's device


@dataclass(slots=True)
class AllowedTokens:
    """Rows restricted to their ``allowed_token_ids``."""

    rows: torch.Tensor | None  # [A] int64 rows of the batch; None: every row, in order
    blocked: torch.Tensor  # [A, V] bool: True where the token is not allowed
    host_rows: list[int]  # the rows, host side (sizes the verifier's expansion without a sync)


@dataclass(slots=True)
class LogitBias:
    """Every bias entry of the batch, flattened: ``logits[rows, token_ids] += values``."""

    rows: torch.Tensor  # [B] int64
    token_ids: torch.Tensor  # [B] int64
    values: torch.Tensor  # [B] fp32
    host_counts: dict[int, int]  # row -> its number of entries, host side


def build_allowed(
    params: Sequence[SamplingParams], vocab_size: int, move: Move
) -> AllowedTokens | None:
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return None
    lists = [params[i].allowed_token_ids or [] for i in rows]
    width = max(len(ids) for ids in lists)
    # ids at or beyond the vocabulary (refused upstream) land in a dropped extra column
    pad = vocab_size
    padded = [[min(t, pad) for t in ids] + [pad] * (width - len(ids)) for ids in lists]
    blocked = torch.ones(len(rows), vocab_size + 1, dtype=torch.bool)
    blocked.scatter_(1, torch.tensor(padded, dtype=torch.int64), False)
    every_row = len(rows) == len(params)
    return AllowedTokens(
        rows=None if every_row else move(torch.tensor(rows, dtype=torch.int64)),
        blocked=move(blocked[:, :vocab_size]),
        host_rows=rows,
    )


def build_bias(params: Sequence[SamplingParams], vocab_size: int, move: Move) -> LogitBias | None:
    rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    counts: dict[int, int] = {}
    for i, p in enumerate(params):
        if p.logit_bias:
            entries = [(t, v) for t, v in p.logit_bias.items() if t < vocab_size]
            rows += [i] * len(entries)
            token_ids += [t for t, _ in entries]
            values += [v for _, v in entries]
            counts[i] = len(entries)
    if not rows:
        return None
    return LogitBias(
        rows=move(torch.tensor(rows, dtype=torch.int64)),
        token_ids=move(torch.tensor(token_ids, dtype=torch.int64)),
        values=move(torch.tensor(values, dtype=torch.float32)),
        host_counts=counts,
    )


def apply_allowed(logits: torch.Tensor, allowed: AllowedTokens) -> None:
    """Tokens outside each restricted row's allowed set to -inf, in place."""
    if allowed.rows is None:
        logits.masked_fill_(allowed.blocked, float("-inf"))
    else:
        logits[allowed.rows] = logits[allowed.rows].masked_fill_(allowed.blocked, float("-inf"))


def apply_bias(logits: torch.Tensor, bias: LogitBias) -> None:
    """One sparse add of every bias entry, in place."""
    logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)


def expand(
    rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries of request ``rows[e]`` repeated over that request's ``counts[r]`` consecutive
    rows from ``starts[r]``: (entry index [size], target row [size]); ``size`` (the sum of
    ``counts[rows]``, known on the host) spares a device sync."""
    reps = counts[rows]  # [E]
    index = torch.arange(rows.numel(), device=rows.device)
    entry = torch.repeat_interleave(index, reps, output_size=size)
    first = torch.cumsum(reps, 0) - reps  # [E]: where each entry's run begins
    offset = torch.arange(entry.numel(), device=rows.device) - first[entry]
    return entry, starts[rows][entry] + offset


def expand_allowed(
    allowed: AllowedTokens, starts: torch.Tensor, counts: torch.Tensor, host_counts: list[int]
) -> AllowedTokens:
    """``allowed`` over the verifier's rows: request ``r``'s ``host_counts[r]`` rows from
    ``starts[r]`` (``counts`` on the device)."""
    rows = allowed.rows
    if rows is None:
        rows = torch.arange(allowed.blocked.shape[0], device=allowed.blocked.device)
    size = sum(host_counts[r] for r in allowed.host_rows)
    entry, target = expand(rows, starts, counts, size)
    return AllowedTokens(target, allowed.blocked[entry], [])


def expand_bias(
    bias: LogitBias, starts: torch.Tensor, counts: torch.Tensor, host_counts: list[int]
) -> LogitBias:
    """``bias`` over the verifier's rows (as ``expand_allowed``)."""
    size = sum(host_counts[r] * n for r, n in bias.host_counts.items())
    entry, target = expand(bias.rows, starts, counts, size)
    values = bias.values[entry]
    return LogitBias(target, bias.token_ids[entry], values, {})
