"""Linear layers that hold their tensor-parallel shard and know how to load it.

Weights load in ``nn.Linear``'s ``[out, in]`` layout; after loading,
``layers.weight_quantizing`` may turn them into integer codes (``kernels.quant_gemm``) and
``layers.weight_packing`` may repack the float ones for the device's matmul
(``kernels.gemm.linear`` runs any of them).
Every parameter carries ``weight_loader(param, loaded, shard_id)``: it narrows a full checkpoint
tensor to this rank's part and copies it in, checking shapes, and ``required_shards``: the shard
ids a complete load must cover (``{None}`` for a plain tensor). A weight that may be kept
quantized also carries ``quantized_parts`` (``QuantizedParts``): its loader keeps the rows of a
checkpoint tensor that came as a ``QuantizedTensor`` there instead of copying floats.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from shoal.kernels import gemm
from shoal.kernels.gemm import PreparedWeight
from shoal.workers.layers.hookless import HooklessModule
from shoal.workers.layers.quantized_parts import QuantizedParts
from shoal.workers.layers.quantized_tensor import QuantizedTensor
from shoal.workers.parallel import TPContext

Loaded = torch.Tensor | QuantizedTensor  # what a weight loader receives


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


def store_checked(
    param: nn.Parameter, dest: torch.Tensor, src: Loaded, first_row: int, what: str
) -> None:
    """``src`` into ``dest``, the rows of ``param`` from ``first_row``: a quantized tensor kept
    in ``param.quantized_parts`` when the parameter has them, anything else copied as floats."""
    parts: QuantizedParts | None = getattr(param, "quantized_parts", None)
    if isinstance(src, QuantizedTensor) and parts is not None:
        if tuple(dest.shape) != src.shape:
            raise WeightShapeError(
                f"{what}: checkpoint shape {src.shape} does not match expected {tuple(dest.shape)}"
            )
        parts.put(first_row, src)
        return
    if parts is not None:
        parts.discard(first_row)
    copy_checked(dest, src.dequantize() if isinstance(src, QuantizedTensor) else src, what)


def make_param(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: str | torch.device,
    loader: Callable[..., None],
    required_shards: frozenset[Hashable] = frozenset({None}),
    *,
    quantizable: bool = False,
) -> nn.Parameter:
    """An empty parameter with its loader; ``quantizable``: its loader may keep quantized
    rows (``quantized_parts``)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.required_shards = required_shards  # type: ignore[attr-defined]
    if quantizable:
        param.quantized_parts = QuantizedParts(shape[0])  # type: ignore[attr-defined]
    return param


def replace_weight(module: nn.Module, weight: torch.Tensor | PreparedWeight) -> None:
    """``module.weight`` from now on: a tensor as a parameter, a quantized or strip-packed
    weight as a plain attribute (no parameter: nothing trains or moves it)."""
    if hasattr(module, "weight"):
        del module.weight
    if isinstance(weight, torch.Tensor):
        module.weight = nn.Parameter(weight, requires_grad=False)
    else:
        setattr(module, "weight", weight)  # noqa: B010 (a plain attribute, not a parameter)


def _plain_loader(param: nn.Parameter, loaded: Loaded, shard_id: Hashable = None) -> None:
    store_checked(param, param.data, loaded, 0, "tensor")


class ReplicatedLinear(HooklessModule):
    """The full weight on every rank (routers, shared-expert gates)."""

    weight: torch.Tensor | PreparedWeight

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, device) -> None:
        super().__init__()
        self.weight = make_param(
            (out_features, in_features), dtype, device, _plain_loader, quantizable=True
        )
        self.bias = make_param((out_features,), dtype, device, _plain_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.linear(x, self.weight, self.bias)


class ColumnParallelLinear(HooklessModule):
    """Output features split across ranks; the checkpoint tensor is the concatenation of
    ``output_sizes`` parts (one per shard id), each split on its own across ranks."""

    weight: torch.Tensor | PreparedWeight

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
        self.weight = make_param(
            (total, in_features), dtype, device, self._load, required, quantizable=True
        )
        self.bias = make_param((total,), dtype, device, self._load, required) if bias else None

    def _load(self, param: nn.Parameter, loaded: Loaded, shard_id: Hashable = None) -> None:
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
        store_checked(param, dest, src, self.offsets[shard_id], f"shard {shard_id!r}")

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


class RowParallelLinear(HooklessModule):
    """Input features split across ranks; partial outputs are summed with an all-reduce and the
    bias (unsplit) is added once, after it."""

    weight: torch.Tensor | PreparedWeight

    def __init__(
        self, in_features: int, out_features: int, tp: TPContext, *, bias: bool, dtype, device
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_per_rank = tp.divide(in_features, "input features")
        self.weight = make_param(
            (out_features, self.in_per_rank), dtype, device, self._load, quantizable=True
        )
        self.bias = make_param((out_features,), dtype, device, _plain_loader) if bias else None

    def _load(self, param: nn.Parameter, loaded: Loaded, shard_id: Hashable = None) -> None:
        expected = (param.shape[0], self.in_per_rank * self.tp.size)
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(
                f"checkpoint shape {tuple(loaded.shape)} does not match expected {expected}"
            )
        src = loaded.narrow(1, self.tp.rank * self.in_per_rank, self.in_per_rank)
        store_checked(param, param.data, src, 0, "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(gemm.linear(x, self.weight))
        return out if self.bias is None else out + self.bias
