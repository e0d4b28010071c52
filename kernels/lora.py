"""Batched LoRA for a mixed batch (Punica's SGMV shape): every token adds its own adapter's
low-rank product to a linear layer's output, ``y[t] += B[s_t] @ (A[s_t] @ x[t])``.

Adapters sit in fixed slots of two stacks per layer: ``a`` ``[slots, R, in]`` (the shrink) and
``b`` ``[slots, out, R]`` (the expand, the adapter's scaling folded in). A layer fusing several
projections (q/k/v, gate/up) gives each part its own block of R's rank columns and B is block
diagonal, so one shrink and one expand serve them all.

``LoRAMapping`` is one step's tokens grouped by slot, built once and shared by every layer:
runs of adjacent tokens with one adapter when the batch has few of them (no copies), else the
tokens gathered in slot order (one gather and one scatter-add per layer). The torch path runs
two matmuls per group; the Triton kernels (``lora_triton``) take the per-token slots directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from shoal.kernels._backend import use_triton
from shoal.kernels.lora_triton import add_lora_triton

NO_ADAPTER = -1


@dataclass(frozen=True)
class LoRAMapping:
    """Which adapter slot each of a step's ``T`` tokens uses, grouped for the matmuls."""

    token_slots: torch.Tensor  # [T] int32 on the device; NO_ADAPTER: the base model alone
    # (slot, start, end): with ``order`` None, rows start:end of the batch; else rows
    # order[start:end] of it
    groups: tuple[tuple[int, int, int], ...]
    order: torch.Tensor | None  # [N] int64: the tokens that have an adapter, by slot

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
    )


def add_lora_torch(
    y: torch.Tensor,  # [T, out], updated in place
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, R, in]
    b: torch.Tensor,  # [slots, out, R]
    mapping: LoRAMapping,
) -> None:
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
