"""Linear layers that hold their tensor-parallel shard and know how to load it.

Weights load in ``nn.Linear``'s ``[out, in]`` layout; after loading, ``layers.weight_packing``
may repack them for the device's matmul (``kernels.gemm.linear`` runs either).
Every parameter carries ``weight_loader(param, loaded, shard_id)``: it narrows a full checkpoint
tensor to this rank's part and copies it in, checking shapes, and ``required_shards``: the shard
ids a complete load must cover (``{None}`` for a plain tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from shoal.kernels import gemm
from shoal.workers.parallel import TPContext


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape does not fit the model's parameter."""


def copy_checked(dest: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dest.shape) != tuple(src.shape):
        raise WeightShapeError(
            f"{what}: checkpoint shape {tuple(src.shape)} does not match expected "
            f"{tuple(dest.shape)}"
        )
    with torch.no_grad():
        dest.copy_(src)


def make_param(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: str | torch.device,
    loader: Callable[..., None],
    required_shards: frozenset[Hashable] = frozenset({None}),
) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.required_shards = required_shards  # type: ignore[attr-defined]
    return param


def _plain_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
    copy_checked(param.data, loaded, "tensor")


class ReplicatedLinear(nn.Module):
    """The full weight on every rank (routers, shared-expert gates)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, device) -> None:
        super().__init__()
        self.weight = make_param((out_features, in_features), dtype, device, _plain_loader)
        self.bias = make_param((out_features,), dtype, device, _plain_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; the checkpoint tensor is the concatenation of
    ``output_sizes`` parts (one per shard id), each split on its own across ranks."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[Hashable, tuple[int, int, int]],
        tp: TPContext,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        """``shard_sizes[shard_id] = (rows this rank holds, first row it takes, rows in the full
        part)``, in output order."""
        super().__init__()
        self.tp = tp
        self.shard_sizes = shard_sizes
        self.offsets: dict[Hashable, int] = {}
        total = 0
        for shard_id, (rows, _, _) in shard_sizes.items():
            self.offsets[shard_id] = total
            total += rows
        required = frozenset(shard_sizes)
        self.weight = make_param((total, in_features), dtype, device, self._load, required)
        self.bias = make_param((total,), dtype, device, self._load, required) if bias else None

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        if shard_id is None and len(self.shard_sizes) == 1:
            shard_id = next(iter(self.shard_sizes))
        if shard_id is None:  # an already merged tensor: load each part in turn
            total = sum(full for _, _, full in self.shard_sizes.values())
            if loaded.shape[0] != total:
                raise WeightShapeError(
                    f"merged checkpoint shape {tuple(loaded.shape)} has {loaded.shape[0]} rows, "
                    f"expected {total}"
                )
            begin = 0
            for sid in self.shard_sizes:
                part_rows = self.shard_sizes[sid][2]
                self._load(param, loaded.narrow(0, begin, part_rows), sid)
                begin += part_rows
            return
        rows, first, full_rows = self.shard_sizes[shard_id]
        expected = (full_rows, *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(
                f"shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)} does not match "
                f"expected {expected}"
            )
        src = loaded.narrow(0, first, rows)
        dest = param.data.narrow(0, self.offsets[shard_id], rows)
        copy_checked(dest, src, f"shard {shard_id!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.linear(x, self.weight, self.bias)


def column_linear(
    in_features: int, part_sizes: list[int], tp: TPContext, *, bias: bool, dtype, device
) -> ColumnParallelLinear:
    """A column-parallel linear whose output is ``len(part_sizes)`` parts (gate/up), each split
    evenly across ranks; shard ids are 0, 1, ...."""
    shards: dict[Hashable, tuple[int, int, int]] = {}
    for i, size in enumerate(part_sizes):
        rows = tp.divide(size, "output features")
        shards[i] = (rows, tp.rank * rows, size)
    return ColumnParallelLinear(in_features, shards, tp, bias=bias, dtype=dtype, device=device)


def qkv_linear(
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tp: TPContext,
    *,
    bias: bool,
    dtype,
    device,
) -> ColumnParallelLinear:
    """Fused q/k/v projection (shard ids ``"q"``, ``"k"``, ``"v"``). KV heads are split when
    there are at least as many as ranks, else each is replicated on ``size // num_kv_heads``
    ranks."""
    heads = tp.divide(num_heads, "num_attention_heads")
    if num_kv_heads >= tp.size:
        kv_heads = tp.divide(num_kv_heads, "num_key_value_heads")
        kv_first = tp.rank * kv_heads
    else:
        if tp.size % num_kv_heads:
            raise ValueError(
                f"tensor-parallel size {tp.size} must be a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        kv_heads = 1
        kv_first = tp.rank // (tp.size // num_kv_heads)
    shards: dict[Hashable, tuple[int, int, int]] = {
        "q": (heads * head_dim, tp.rank * heads * head_dim, num_heads * head_dim),
        "k": (kv_heads * head_dim, kv_first * head_dim, num_kv_heads * head_dim),
        "v": (kv_heads * head_dim, kv_first * head_dim, num_kv_heads * head_dim),
    }
    return ColumnParallelLinear(hidden, shards, tp, bias=bias, dtype=dtype, device=device)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial outputs are summed with an all-reduce and the
    bias (unsplit) is added once, after it."""

    def __init__(
        self, in_features: int, out_features: int, tp: TPContext, *, bias: bool, dtype, device
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_per_rank = tp.divide(in_features, "input features")
        self.weight = make_param((out_features, self.in_per_rank), dtype, device, self._load)
        self.bias = make_param((out_features,), dtype, device, _plain_loader) if bias else None

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        expected = (param.shape[0], self.in_per_rank * self.tp.size)
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(
                f"checkpoint shape {tuple(loaded.shape)} does not match expected {expected}"
            )
        src = loaded.narrow(1, self.tp.rank * self.in_per_rank, self.in_per_rank)
        copy_checked(param.data, src, "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(gemm.linear(x, self.weight))
        return out if self.bias is None else out + self.bias
