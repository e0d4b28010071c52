"""Linear layers that add each token's adapter: the column- and row-parallel projections of a
decoder wrapped with their slots' LoRA stacks (``kernels.lora``'s layout).

A column-parallel layer fusing parts (q/k/v, gate/up) gives part ``p`` the rank columns
``p*R .. p*R+R`` and its rows of B; with tensor parallelism each rank holds A whole and its
rows of B. A row-parallel layer holds its input columns of A and B whole, and adds its partial
product before the all-reduce, as it does the base one.

Every wrapped layer reads one shared ``LoRAStepState``: the step's token mapping, set by the
runner before the forward pass (None: no token has an adapter and the layers add nothing).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from shoal.kernels import gemm
from shoal.kernels.lora import LoRAMapping, add_lora
from shoal.workers.layers.hookless import HooklessModule
from shoal.workers.layers.linear import ColumnParallelLinear, RowParallelLinear


@dataclass
class LoRAStepState:
    mapping: LoRAMapping | None = None


@dataclass(frozen=True)
class PartWeights:
    """One part of one adapter for this rank: A ``[r, in]`` and B ``[rows, r]``, B scaled."""

    a: torch.Tensor
    b: torch.Tensor


class LoRALayer(HooklessModule):
    """A base projection and the ``num_slots`` adapters that may be added to it."""

    lora_a: torch.Tensor  # [slots, parts * max_rank, in]
    lora_b: torch.Tensor  # [slots, out, parts * max_rank], scaled

    def __init__(
        self,
        base: ColumnParallelLinear | RowParallelLinear,
        parts: list[Hashable],
        num_slots: int,
        max_rank: int,
        state: LoRAStepState,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.parts = parts  # shard ids in rank-column order
        self.max_rank = max_rank
        self.state = state
        out_features, in_features = self._shape()
        width = len(parts) * max_rank
        self.register_buffer(
            "lora_a", torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        )
        self.register_buffer(
            "lora_b", torch.zeros(num_slots, out_features, width, dtype=dtype, device=device)
        )

    def _shape(self) -> tuple[int, int]:
        raise NotImplementedError

    def rows_of(self, part: Hashable) -> tuple[int, int]:
        """(first output row, rows) of ``part`` in this rank's output."""
        raise NotImplementedError

    def load_slot(self, slot: int, weights: dict[Hashable, PartWeights]) -> None:
        """Put an adapter's parts (those it has; the others stay zero) in ``slot``."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        for index, part in enumerate(self.parts):
            w = weights.get(part)
            if w is None:
                continue
            rank = w.a.shape[0]
            cols = slice(index * self.max_rank, index * self.max_rank + rank)
            first, rows = self.rows_of(part)
            a[cols].copy_(w.a)
            b[first : first + rows, cols].copy_(w.b)

    def _add(self, out: torch.Tensor, x: torch.Tensor) -> None:
        mapping = self.state.mapping
        if mapping is not None:
            add_lora(out, x.reshape(-1, x.shape[-1]), self.lora_a, self.lora_b, mapping)


class LoRAColumnLinear(LoRALayer):
    base: ColumnParallelLinear

    def _shape(self) -> tuple[int, int]:
        rows, in_features = self.base.weight.shape
        return int(rows), int(in_features)

    def rows_of(self, part: Hashable) -> tuple[int, int]:
        return self.base.offsets[part], self.base.shard_sizes[part][0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        self._add(out, x)
        return out


class LoRARowLinear(LoRALayer):
    base: RowParallelLinear

    def _shape(self) -> tuple[int, int]:
        return int(self.base.weight.shape[0]), self.base.in_per_rank

    def rows_of(self, part: Hashable) -> tuple[int, int]:
        return 0, int(self.base.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        out = gemm.linear(x, base.weight)
        self._add(out, x)
        out = base.tp.all_reduce(out)
        return out if base.bias is None else out + base.bias


@dataclass
class LoRALayers:
    """Every wrapped layer of a model by its module path, and the state they share."""

    state: LoRAStepState
    layers: dict[str, LoRALayer] = field(default_factory=dict)
