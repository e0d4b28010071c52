"""Batched LoRA for a mixed batch (Punica's SGMV shape): every token adds its own adapter's
low-rank product to a linear layer's output, ``y[t] += B[s_t] @ (A[s_t] @ x[t])``.

Adapters sit in fixed slots of two stacks per layer: ``a`` ``[slots, R, in]`` (the shrink) and
``b`` ``[slots, out, R]`` (the expand, the adapter's scaling folded in). A layer fusing several
projections (q/k/v, gate/up) gives each part its own block of R's rank columns and B is block
diagonal, so one shrink and one expand serve them all.

``LoRAMapping`` is one step's tokens grouped by slot, built once and shared by every layer:
runs of adjacent tokens with one adapter when the batch has few of them (no copies), else the
tokens gathered in slot order (one gather and one scatter-add per layer). The torch path runs
two matmuls per group, or, when there are many small groups (decodes spread over adapters), two
batched matmuls over every slot up to the highest in use, each slot's tokens padded to the
longest group (``PaddedGroups``: a few ops per layer whatever the number of adapters, and the
slot stacks read in place). The Triton kernels (``lora_triton``) take the per-token slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from shoal.kernels._backend import use_triton
from shoal.kernels.lora_triton import add_lora_triton

NO_ADAPTER = -1


MIN_PADDED_GROUPS = 3  # fewer groups: a matmul pair each costs less than the padding
MAX_PADDING = 2.0  # padded rows at most this many times the tokens with an adapter


@dataclass(frozen=True)
class PaddedGroups:
    """Slots ``0..num_slots-1``, ``rows`` rows each: row ``r`` of slot ``s`` holds the token
    ``index[s * rows + r]`` (padding: token 0, computed and dropped)."""

    num_slots: int
    rows: int
    index: torch.Tensor  # [num_slots * rows] int64
    kept: torch.Tensor  # [N] int64: the padded rows that hold a token with an adapter
    tokens: torch.Tensor  # [N] int64: their tokens


@dataclass(frozen=True)
class LoRAMapping:
    """Which adapter slot each of a step's ``T`` tokens uses, grouped for the matmuls."""

    token_slots: torch.Tensor  # [T] int32 on the device; NO_ADAPTER: the base model alone
    # (slot, start, end): with ``order`` None, rows start:end of the batch; else rows
    # order[start:end] of it
    groups: tuple[tuple[int, int, int], ...]
    order: torch.Tensor | None  # [N] int64: the tokens that have an adapter, by slot
    padded: PaddedGroups | None = None  # the batched form, when it pays

    @property
    def num_groups(self) -> int:
        return len(self.groups)


def _runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of adjacent tokens sharing a slot, those with an adapter."""
    if len(slots) == 0:
        return []
    starts = np.flatnonzero(np.diff(slots)) + 1
    bounds = [0, *starts.tolist(), len(slots)]
    return [
        (int(slots[begin]), begin, end)
        for begin, end in pairwise(bounds)
        if slots[begin] != NO_ADAPTER
    ]


def build_mapping(token_slots: np.ndarray, device: torch.device | str) -> LoRAMapping | None:
    """The step's mapping from each token's slot (``NO_ADAPTER`` for none); None when no
    token has an adapter (the layers then skip LoRA altogether)."""
    slots = np.asarray(token_slots, dtype=np.int32)
    with_adapter = slots != NO_ADAPTER
    if not with_adapter.any():
        return None
    runs = _runs(slots)
    distinct = np.unique(slots[with_adapter])
    order: torch.Tensor | None = None
    groups = runs
    if len(runs) > len(distinct):  # interleaved adapters: gather each one's tokens together
        index = np.flatnonzero(with_adapter)
        index = index[np.argsort(slots[index], kind="stable")]
        sorted_slots = slots[index]
        groups = [(slot, begin, end) for slot, begin, end in _runs(sorted_slots)]
        order = torch.from_numpy(index.astype(np.int64)).to(device)
    return LoRAMapping(
        token_slots=torch.from_numpy(slots).to(device),
        groups=tuple(groups),
        order=order,
        padded=_padded(slots, len(distinct), device),
    )


def _padded(
    slots: np.ndarray, num_distinct: int, device: torch.device | str
) -> PaddedGroups | None:
    """The batched layout, when there are enough groups and little padding."""
    if num_distinct < MIN_PADDED_GROUPS:
        return None
    tokens = np.flatnonzero(slots != NO_ADAPTER)
    token_slots = slots[tokens].astype(np.int64)
    tokens = tokens[np.argsort(token_slots, kind="stable")]
    token_slots = np.sort(token_slots, kind="stable")
    counts = np.bincount(token_slots)
    num_slots, rows = len(counts), int(counts.max())
    if num_slots * rows > MAX_PADDING * len(tokens):
        return None
    first = np.zeros(num_slots, np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    kept = token_slots * rows + (np.arange(len(tokens)) - first[token_slots])
    index = np.zeros(num_slots * rows, np.int64)
    index[kept] = tokens
    return PaddedGroups(
        num_slots=num_slots,
        rows=rows,
        index=torch.from_numpy(index).to(device),
        kept=torch.from_numpy(kept).to(device),
        tokens=torch.from_numpy(tokens.astype(np.int64)).to(device),
    )


def add_lora_torch(
    y: torch.Tensor,  # [T, out], updated in place
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, R, in]
    b: torch.Tensor,  # [slots, out, R]
    mapping: LoRAMapping,
) -> None:
    if mapping.padded is not None:
        _add_padded(y, x, a, b, mapping.padded)
        return
    if mapping.order is None:
        for slot, start, end in mapping.groups:
            shrunk = x[start:end] @ a[slot].t()  # [n, R]
            y[start:end].addmm_(shrunk, b[slot].t())
        return
    gathered = x.index_select(0, mapping.order)  # [N, in]
    delta = torch.empty((gathered.shape[0], y.shape[1]), dtype=y.dtype, device=y.device)
    for slot, start, end in mapping.groups:
        torch.mm(gathered[start:end] @ a[slot].t(), b[slot].t(), out=delta[start:end])
    y.index_add_(0, mapping.order, delta)


def _add_padded(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, padded: PaddedGroups
) -> None:
    """Two batched matmuls over slots ``0..num_slots-1`` (views of the stacks, no copy)."""
    slots, rows = padded.num_slots, padded.rows
    gathered = x.index_select(0, padded.index).view(slots, rows, x.shape[1])
    shrunk = torch.bmm(gathered, a[:slots].transpose(1, 2))  # [slots, rows, R]
    delta = torch.bmm(shrunk, b[:slots].transpose(1, 2)).view(slots * rows, y.shape[1])
    y.index_add_(0, padded.tokens, delta.index_select(0, padded.kept))


def add_lora(
    y: torch.Tensor,  # [T, out], updated in place
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, R, in]
    b: torch.Tensor,  # [slots, out, R]
    mapping: LoRAMapping,
) -> None:
    """``y[t] += b[s] @ (a[s] @ x[t])`` for each token ``t`` whose slot ``s`` is not
    ``NO_ADAPTER``; the rest of ``y`` is left as it is."""
    if use_triton(y):
        add_lora_triton(y, x, a, b, mapping.token_slots)
    else:
        add_lora_torch(y, x, a, b, mapping)
