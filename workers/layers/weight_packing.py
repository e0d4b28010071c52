"""After loading: every linear layer's float weight repacked for the matmul this device runs
fastest (``kernels.gemm``): on the CPU, shoal's strips or oneDNN's blocked layout, replacing the
loaded weight (no second copy), except a tied LM head, which gets its own packed copy while the
embedding keeps the rows it looks up. Weights kept as integer codes (``QuantizedWeight``) stay as
they are.
Runs once per loaded model, before the first forward.
"""

from __future__ import annotations

from typing import TypeGuard

import torch
from torch import nn

from shoal.kernels import gemm
from shoal.workers.layers.embedding import LMHead
from shoal.workers.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    replace_weight,
)

LINEAR_LAYERS = (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)


def pack_linear_weights(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> str:
    """Repack ``model``'s linear and LM-head weights for ``gemm.gemm_backend(device, dtype)``;
    returns the backend (``dense``: nothing changed)."""
    backend = gemm.gemm_backend(device, dtype)
    if backend == gemm.DENSE:
        return backend
    for module in model.modules():
        if isinstance(module, LINEAR_LAYERS) and _packable(module.weight):
            replace_weight(module, gemm.pack_weight(module.weight, backend))
        elif isinstance(module, LMHead) and _packable(weight := module.head_weight()):
            module.use_weight(gemm.pack_weight(weight, backend))
    return backend


def _packable(weight: torch.Tensor | gemm.PreparedWeight) -> TypeGuard[torch.Tensor]:
    """A plain float tensor as loaded (not packed or quantized already)."""
    return isinstance(weight, torch.Tensor) and not weight.is_mkldnn
