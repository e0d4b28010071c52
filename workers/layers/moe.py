"""Sparse MoE feed-forward: router softmax → top-k (renormalised as configured) → fused experts,
plus Qwen2-MoE's sigmoid-gated shared expert. Experts are replicated (no expert parallelism)."""

from __future__ import annotations

import torch
from torch import nn

from shoal.kernels import ops
from shoal.workers.config import MoeConfig
from shoal.workers.layers.linear import ReplicatedLinear, copy_checked, make_param


class FusedExperts(nn.Module):
    """All experts' weights as two stacked tensors, the layout ``kernels.ops.fused_moe`` takes.

    Loads either per-expert tensors (shard ids ``(expert, 0|1)`` for gate/up rows of ``w13``,
    ``(expert, None)`` for ``w2``) or transformers 5.x fused tensors (shard id None).
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, *, dtype, device) -> None:
        super().__init__()
        self.inter = inter
        gate_up = frozenset((e, part) for e in range(num_experts) for part in (0, 1))
        down = frozenset((e, None) for e in range(num_experts))
        self.w13 = make_param((num_experts, 2 * inter, hidden), dtype, device, self._load, gate_up)
        self.w2 = make_param((num_experts, hidden, inter), dtype, device, self._load, down)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:  # type: ignore[no-untyped-def]
        if shard_id is None:
            copy_checked(param.data, loaded, "fused experts")
            return
        expert, part = shard_id
        dest = param.data[expert]
        if part is not None:
            dest = dest.narrow(0, part * self.inter, self.inter)
        copy_checked(dest, loaded, f"expert {expert}")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return ops.fused_moe(x, self.w13, self.w2, weights, ids)


class SparseMoeBlock(nn.Module):
    def __init__(
        self, hidden: int, moe: MoeConfig, shared_expert: nn.Module | None, *, dtype, device
    ) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = ReplicatedLinear(
            hidden, moe.num_experts, bias=False, dtype=dtype, device=device
        )
        self.experts = FusedExperts(
            moe.num_experts, hidden, moe.intermediate_size, dtype=dtype, device=device
        )
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            ReplicatedLinear(hidden, 1, bias=False, dtype=dtype, device=device)
            if shared_expert is not None
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        router_logits = self.gate(x)  # [T, num_experts]
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, top_k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, weights.to(x.dtype), ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return out
