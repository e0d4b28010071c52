"""RMSNorm with an optional fused residual add (``kernels.ops.rms_norm``)."""

from __future__ import annotations

import torch

from shoal.kernels import ops
from shoal.workers.layers.hookless import HooklessModule
from shoal.workers.layers.linear import _plain_loader, make_param


class RMSNorm(HooklessModule):
    def __init__(self, hidden: int, eps: float, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param((hidden,), dtype, device, _plain_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
        """``norm(x)``, or ``(norm(x + residual), x + residual)`` when a residual is given."""
        return ops.rms_norm(x, self.weight, self.eps, residual)
