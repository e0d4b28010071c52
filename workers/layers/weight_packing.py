"""After loading: every linear layer's weight repacked for the matmul this device runs fastest
(``kernels.gemm``): on the CPU, oneDNN's blocked layout, replacing the loaded weight (no second
copy), except a tied LM head, which gets its own packed copy while the embedding keeps the rows
it looks up. Runs once per loaded model, before the first forward.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.kernels import gemm
from shoal.workers.layers.embedding import LMHead
from shoal.workers.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

LINEAR_LAYERS = (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)


def pack_linear_weights(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> str:
    """Repack ``model``'s linear and LM-head weights for ``gemm.gemm_backend(device, dtype)``;
    returns the backend (``dense``: nothing changed)."""
    backend = gemm.gemm_backend(device, dtype)
    if backend == gemm.DENSE:
        return backend
    for module in model.modules():
        if isinstance(module, LINEAR_LAYERS) and not module.weight.is_mkldnn:
            module.weight = nn.Parameter(gemm.pack_weight(module.weight), requires_grad=False)
        elif isinstance(module, LMHead) and not module.head_weight().is_mkldnn:
            module.use_weight(gemm.pack_weight(module.head_weight()))
    return backend
