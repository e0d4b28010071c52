"""Structured outputs in the worker: a step's ``GrammarBitmask`` (from the engine core, which
advances each request's grammar) applied to the logits before sampling: a token whose bit is
clear gets ``-inf``, batched over the masked rows in one ``masked_fill``. Rows of requests the
bitmask does not list are not touched, and a step without one costs nothing."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from shoal.bus.messages.structured import GrammarBitmask

_BIT = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: GrammarBitmask, vocab_size: int) -> torch.Tensor:
    """``[len(req_ids), vocab_size]`` bool: which tokens each listed request may sample."""
    words = np.frombuffer(bitmask.data, dtype="<i4").reshape(len(bitmask.req_ids), bitmask.words)
    bits = (torch.from_numpy(words.astype(np.int32)).unsqueeze(-1) >> _BIT) & 1
    allowed = bits.reshape(len(bitmask.req_ids), -1).bool()
    if allowed.shape[1] < vocab_size:  # columns past the grammar's vocabulary: never allowed
        padding = torch.zeros(allowed.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool)
        allowed = torch.cat([allowed, padding], dim=1)
    return allowed[:, :vocab_size]


def apply_grammar_bitmask(
    logits: torch.Tensor, row_of: Mapping[str, int], bitmask: GrammarBitmask | None
) -> None:
    """In place: the logits rows of each request the bitmask lists (``row_of``: request id →
    its first row in ``logits``; its ``k``-th bitmask row masks row ``first + k``, a verified
    draft's position) keep only their allowed tokens. Listed requests not in ``row_of`` (not
    sampling in this batch) are skipped."""
    if bitmask is None:
        return
    listed: list[tuple[int, int]] = []
    seen: dict[str, int] = {}
    for i, request_id in enumerate(bitmask.req_ids):
        if request_id in row_of:
            offset = seen[request_id] = seen.get(request_id, -1) + 1
            listed.append((i, row_of[request_id] + offset))
    if not listed:
        return
    allowed = allowed_tokens(bitmask, logits.shape[-1])
    masks = allowed[[i for i, _ in listed]].to(logits.device)
    rows = torch.tensor([row for _, row in listed], device=logits.device)
    logits[rows] = logits[rows].masked_fill(~masks, float("-inf"))
