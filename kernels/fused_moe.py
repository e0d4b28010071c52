"""Mixture-of-experts feed-forward over routed tokens: torch reference and Triton grouped GEMM.

``w13`` holds each expert's gate rows then up rows (``[num_experts, 2 * inter, hidden]``, the
nn.Linear layout), ``w2`` its down projection (``[num_experts, hidden, inter]``). Routing (softmax,
top-k, renormalisation) is the model's job: this module takes ``topk_ids``/``topk_weights``.
"""

import torch
import torch.nn.functional as F

from kernels._triton import require_triton, tl, triton


def sort_by_expert(
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments ordered by expert, then by top-k rank, then by token (transformers' order).

    Returns the flat assignment indices into ``topk_ids.flatten()`` ([num_tokens * top_k]) and
    the number of assignments per expert id ([max_id + 1]).
    """
    num_tokens, top_k = topk_ids.shape
    rank_major = topk_ids.t().reshape(-1)  # [top_k * num_tokens], index = rank * T + token
    order = torch.sort(rank_major, stable=True).indices
    token = order % num_tokens
    rank = order // num_tokens
    counts = torch.bincount(rank_major.long())
    return token * top_k + rank, counts


def fused_moe_torch(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
) -> torch.Tensor:  # [num_tokens, hidden]
    """Loop over the experts that have tokens: gather, two matmuls, weighted index_add."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    top_k = topk_ids.shape[1]
    assignments, counts = sort_by_expert(topk_ids)
    flat_weights = topk_weights.reshape(-1)
    begin = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        chosen = assignments[begin : begin + count]  # [count] flat assignment indices
        begin += count
        tokens = chosen // top_k
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, w2[expert])  # [count, hidden]
        expert_out = expert_out * flat_weights[chosen, None]
        out.index_add_(0, tokens, expert_out.to(out.dtype))
    return out


def fused_moe_triton(*args, **kwargs):  # type: ignore[no-untyped-def]
    """Triton kernel: not written yet."""
    require_triton()
    raise NotImplementedError("fused_moe_triton: Triton kernel not written yet")
