"""Paged attention for decode steps (one query token per sequence): torch reference and Triton.

Each sequence's context is its first ``seq_len`` cache slots, read through its block table; the
single query sits at the last position, so it attends to the whole context.
"""

import torch

from kernels._triton import require_triton, tl, triton
from kernels.paged_common import check_paged_inputs, dot_precision
from kernels.prefill_attention import varlen_attention_torch


def decode_attention_torch(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """Torch reference: the varlen path with one query per sequence."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return varlen_attention_torch(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale
    )


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    scale,
    q_stride_t,
    q_stride_h,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    table_stride,
    group,
    head_dim,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (sequence, kv head): its ``group`` query heads against every page."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    heads = kv_head * group + tl.arange(0, BLOCK_G)  # query heads of this kv head
    dims = tl.arange(0, BLOCK_D)
    head_ok = tl.arange(0, BLOCK_G) < group
    dim_ok = dims < head_dim
    q_offsets = seq * q_stride_t + heads[:, None] * q_stride_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    slots = tl.arange(0, PAGE)
    kv_offsets = kv_head * cache_stride_head + slots[:, None] * cache_stride_slot + dims[None, :]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for page in range(0, tl.cdiv(seq_len, PAGE)):
        block = tl.load(block_tables_ptr + seq * table_stride + page).to(tl.int64)
        key_ok = page * PAGE + slots < seq_len
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        base = block * cache_stride_block + kv_offsets
        k = tl.load(k_cache_ptr + base, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + base, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [G, PAGE]
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    out_offsets = seq * q_stride_t + heads[:, None] * q_stride_h + dims[None, :]
    out_mask = head_ok[:, None] & dim_ok[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton version of :func:`decode_attention_torch` (one query token per sequence)."""
    require_triton()
    check_paged_inputs(q, k_cache, v_cache, block_tables)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32
    assert block_tables.shape[0] == num_seqs
    out = torch.empty_like(q)
    group = num_q_heads // num_kv_heads
    if num_seqs:
        _decode_attention_kernel[(num_seqs, num_kv_heads)](
            q, k_cache, v_cache, block_tables, seq_lens, out, scale,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), group, head_dim,
            BLOCK_G=max(16, triton.next_power_of_2(group)),
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            PAGE=k_cache.shape[1],
            DOT_PRECISION=dot_precision(q.dtype),
        )  # fmt: skip
    return out
