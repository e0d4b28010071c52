"""Rotary position embedding: a cos/sin cache built once, applied with ``kernels.ops``."""

from __future__ import annotations

import torch

from shoal.kernels import ops
from shoal.workers.config import RopeConfig
from shoal.workers.layers.hookless import HooklessModule


class RotaryEmbedding(HooklessModule):
    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, *, device) -> None:
        super().__init__()
        scaling = {"rope_type": rope.rope_type, **rope.scaling}
        cache = ops.build_cos_sin_cache(head_dim, max_positions, rope.theta, scaling=scaling)
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache: torch.Tensor = self.cos_sin_cache  # type: ignore[assignment]
        return ops.apply_rotary(q, k, positions, cache, is_neox=True)
