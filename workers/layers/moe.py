"""Sparse MoE feed-forward: router softmax → top-k (renormalised as configured) → fused experts,
plus Qwen2-MoE's sigmoid-gated shared expert. Experts are replicated, or with an ``EPContext``
spread over the expert-parallel ranks (``workers.moe.expert_parallel``); the router and the
shared expert stay replicated either way."""

from __future__ import annotations

import torch
from torch import nn

from shoal.kernels import ops
from shoal.workers.config import MoeConfig
from shoal.workers.layers.hookless import HooklessModule
from shoal.workers.layers.linear import ReplicatedLinear, copy_checked, make_param
from shoal.workers.moe.expert_parallel import EPContext, expert_parallel_moe


class FusedExperts(HooklessModule):
    """The held experts' weights as two stacked tensors, the layout ``kernels.ops.fused_moe``
    takes: all experts, or with ``ep`` only this rank's (row i = global expert ``first + i``).

    Loads either per-expert tensors (shard ids ``(expert, 0|1)`` for gate/up rows of ``w13``,
    ``(expert, None)`` for ``w2``; other ranks' experts are skipped) or transformers 5.x fused
    tensors of every expert (shard id None; this rank's rows are taken).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        *,
        dtype,
        device,
        ep: EPContext | None = None,
    ) -> None:
        super().__init__()
        self.inter = inter
        self.num_experts = num_experts
        self.ep = ep
        self.held = ep.local_experts(num_experts) if ep is not None else range(num_experts)
        n = len(self.held)
        gate_up = frozenset((e, part) for e in self.held for part in (0, 1))
        down = frozenset((e, None) for e in self.held)
        self.w13 = make_param((n, 2 * inter, hidden), dtype, device, self._load, gate_up)
        self.w2 = make_param((n, hidden, inter), dtype, device, self._load, down)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:  # type: ignore[no-untyped-def]
        if shard_id is None:
            if loaded.dim() < 1 or loaded.shape[0] != self.num_experts:
                raise ValueError(
                    f"fused experts: checkpoint shape {tuple(loaded.shape)} does not hold "
                    f"{self.num_experts} experts"
                )
            copy_checked(param.data, loaded[self.held.start : self.held.stop], "fused experts")
            return
        expert, part = shard_id
        if expert not in self.held:
            if not 0 <= expert < self.num_experts:
                raise IndexError(f"expert {expert} of {self.num_experts}")
            return  # another rank's expert
        dest = param.data[expert - self.held.start]
        if part is not None:
            dest = dest.narrow(0, part * self.inter, self.inter)
        copy_checked(dest, loaded, f"expert {expert}")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.ep is None or self.ep.size == 1:  # every expert is here
            return ops.fused_moe(x, self.w13, self.w2, weights, ids)
        return expert_parallel_moe(x, weights, ids, self.w13, self.w2, self.ep, self.num_experts)


class SparseMoeBlock(HooklessModule):
    def __init__(
        self,
        hidden: int,
        moe: MoeConfig,
        shared_expert: nn.Module | None,
        *,
        dtype,
        device,
        ep: EPContext | None = None,
    ) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = ReplicatedLinear(
            hidden, moe.num_experts, bias=False, dtype=dtype, device=device
        )
        self.experts = FusedExperts(
            moe.num_experts, hidden, moe.intermediate_size, dtype=dtype, device=device, ep=ep
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
