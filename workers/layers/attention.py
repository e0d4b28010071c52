"""Paged self-attention over one flattened batch of prefill chunks and decodes.

``AttentionMetadata`` describes the batch (built once per step by the model runner and shared by
every layer); each ``PagedAttention`` layer owns a view of its K/V cache tensors, bound by the
runner after allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shoal.kernels import ops
from shoal.workers.layers.hookless import HooklessModule


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit: one row per scheduled request, in batch order."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot of each token (block * block_size + off)
    block_tables: torch.Tensor  # [S, max_blocks] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32, computed + scheduled tokens
    max_query_len: int
    max_seq_len: int
    attention_plan: Any = None  # ops.plan_paged_attention's, made by the first layer to run
    decode_step: Any = None  # ops.plan_decode_step's (False: none serves the step), likewise


class PagedAttention(HooklessModule):
    """Writes this step's K/V into the cache pages, then attends over each request's pages."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads, head_dim]
        self.v_cache: torch.Tensor | None = None

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def plan_decode_step(
        self,
        qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim]: q, k, v
        positions: torch.Tensor,  # [T] int64
        cos_sin_cache: torch.Tensor,  # the rotary's
        meta: AttentionMetadata,
    ) -> Any:
        """``ops.plan_decode_step``'s plan of the step (made by the first layer to ask, for
        every layer), or None where the one call does not serve the step."""
        if meta.decode_step is None:
            k_cache, _ = self._caches()
            q = qkv.view(qkv.shape[0], -1, self.head_dim)[:, : self.num_heads]
            meta.decode_step = ops.plan_decode_step(
                qkv, positions, meta.slot_mapping, cos_sin_cache, k_cache, self.num_heads,
                self._step_plan(q, k_cache, meta),
            ) or False  # fmt: skip
        return meta.decode_step or None

    def decode_step(
        self,
        qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim]: q, k, v
        step: Any,  # plan_decode_step's
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        """Rotary, the K/V write and attention in one kernel call on a step of decodes the CPU
        kernel serves (the same answer as rotary then ``forward``)."""
        k_cache, v_cache = self._caches()
        return ops.decode_step(qkv, k_cache, v_cache, step, self.scale)

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        k_cache, v_cache = self._caches()
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        plan = self._step_plan(q, k_cache, meta)
        out = ops.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            plan=plan,
        )
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def _caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("attention layer has no KV cache bound (call ModelRunner.load)")
        return self.k_cache, self.v_cache

    @staticmethod
    def _step_plan(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> Any:
        """``ops.plan_paged_attention``'s plan of the step, made by the first layer to ask
        (every layer's cache has the same shape)."""
        if meta.attention_plan is None:
            meta.attention_plan = ops.plan_paged_attention(
                q, k_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens
            )
        return meta.attention_plan
