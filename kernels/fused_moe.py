"""Mixture-of-experts feed-forward over routed tokens: torch reference and Triton grouped GEMM.

``w13`` holds each expert's gate rows then up rows (``[num_experts, 2 * inter, hidden]``, the
nn.Linear layout), ``w2`` its down projection (``[num_experts, hidden, inter]``). Routing (softmax,
top-k, renormalisation) is the model's job: this module takes ``topk_ids``/``topk_weights``.
"""

import torch
import torch.nn.functional as F

from shoal.kernels._triton import require_triton, tl, triton
from shoal.kernels.activation import silu_and_mul_triton


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


def align_by_expert(
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group assignments by expert, each group padded to a multiple of ``block_m``, on device
    and without a host sync.

    Returns ``sorted_ids`` ([capacity]: flat assignment indices, padding = ``num_assignments``)
    and ``block_experts`` ([capacity // block_m]: the expert of each row tile, -1 when unused).
    """
    flat = topk_ids.reshape(-1).long()  # [num_assignments]
    num_assignments = flat.numel()
    capacity = triton.cdiv(num_assignments + num_experts * (block_m - 1), block_m) * block_m
    order = torch.sort(flat, stable=True).indices  # assignments grouped by expert
    # [num_experts]; not bincount, which reads its output size from the device (no sync here,
    # so a CUDA graph can hold this)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    group_start = torch.cumsum(counts, 0) - counts
    experts_in_order = flat[order]
    rank_in_group = (
        torch.arange(num_assignments, device=flat.device) - group_start[experts_in_order]
    )
    dest = (padded_end - padded)[experts_in_order] + rank_in_group
    sorted_ids = torch.full((capacity,), num_assignments, dtype=torch.int64, device=flat.device)
    sorted_ids[dest] = order
    tile_start = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, tile_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_ids, block_experts


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_assignments,
    N,
    K,
    a_row_divisor,
    a_stride_row,
    b_stride_expert,
    b_stride_n,
    c_stride_row,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """C[id] = A[id // a_row_divisor] @ B[expert].T (times the routing weight) for one tile of
    one expert's assignments."""
    tile = tl.program_id(0)
    expert = tl.load(block_experts_ptr + tile).to(tl.int64)
    if expert >= 0:
        ids = tl.load(sorted_ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = ids < num_assignments
        a_rows = (ids // a_row_divisor).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k_start in range(0, K, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a_mask = row_ok[:, None] & k_ok[None, :]
            a = tl.load(
                a_ptr + a_rows[:, None] * a_stride_row + ks[None, :], mask=a_mask, other=0.0
            )
            b_offsets = expert * b_stride_expert + cols[None, :].to(tl.int64) * b_stride_n
            b_mask = k_ok[:, None] & col_ok[None, :]
            b = tl.load(b_ptr + b_offsets + ks[:, None], mask=b_mask, other=0.0)  # [K, N]
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        if MUL_WEIGHT:
            weight = tl.load(weights_ptr + ids, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * weight[:, None]
        c_offsets = ids[:, None].to(tl.int64) * c_stride_row + cols[None, :]
        c_mask = row_ok[:, None] & col_ok[None, :]
        tl.store(c_ptr + c_offsets, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _moe_gemm(
    a: torch.Tensor,  # [rows, K]
    b: torch.Tensor,  # [num_experts, N, K]
    c: torch.Tensor,  # [num_assignments, N]
    weights: torch.Tensor,  # [num_assignments] float
    sorted_ids: torch.Tensor,
    block_experts: torch.Tensor,
    a_row_divisor: int,
    mul_weight: bool,
    block_m: int,
) -> None:
    num_n, dim_k = b.shape[1], b.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(num_n)))
    block_k = min(64, max(16, triton.next_power_of_2(dim_k)))
    grid = (block_experts.shape[0], triton.cdiv(num_n, block_n))
    _moe_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, block_experts,
        c.shape[0], num_n, dim_k, a_row_divisor,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        MUL_WEIGHT=mul_weight, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )  # fmt: skip


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_m: int | None = None,
) -> torch.Tensor:
    """Triton grouped GEMMs over expert-sorted assignments: x @ w13[e].T, SiLU-and-mul,
    @ w2[e].T times the routing weight, then a sum over each token's top-k."""
    require_triton()
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    assert x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()
    assert w13.shape == (num_experts, two_inter, hidden), f"w13 {tuple(w13.shape)}"
    assert w2.shape == (num_experts, hidden, two_inter // 2), f"w2 {tuple(w2.shape)}"
    assert x.dtype == w13.dtype == w2.dtype, f"x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    assert topk_weights.is_floating_point() and not topk_ids.is_floating_point()
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    if block_m is None:
        per_expert = num_tokens * top_k / num_experts
        block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    sorted_ids, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).contiguous()
    gate_up = torch.empty(num_tokens * top_k, two_inter, dtype=x.dtype, device=x.device)
    _moe_gemm(x, w13, gate_up, weights, sorted_ids, block_experts, top_k, False, block_m)
    activated = silu_and_mul_triton(gate_up)  # [num_assignments, inter]
    down = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _moe_gemm(activated, w2, down, weights, sorted_ids, block_experts, 1, True, block_m)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
