"""Paged attention for decode steps (one query token per sequence): torch reference and Triton.

Each sequence's context is its first ``seq_len`` cache slots, read through its block table; the
single query sits at the last position, so it attends to the whole context. The Triton kernel
runs one program per (sequence, kv head, context split); when the batch is too small to fill the
GPU, the context is split (flash-decoding) and a second kernel merges the partial softmaxes.
"""

import functools

import torch

from shoal.kernels._triton import require_triton, tl, triton
from shoal.kernels.paged_common import (
    check_paged_inputs,
    default_block_n,
    dot_precision,
    load_kv_tile,
)


def decode_attention_torch(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """Torch reference, one sequence at a time: its context gathered slot by slot through its
    block table, then softmax(q·Kᵀ·scale)·V per query head over its kv head's keys (math in
    fp32 or wider; no mask: the query is the last position)."""
    assert q.shape[0] == seq_lens.shape[0] == block_tables.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads  # query heads per kv head
    math = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    for s, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(seq_len, device=q.device)  # [seq_len]
        pages = block_tables[s].long()[positions // block_size]  # [seq_len]
        offsets = positions % block_size
        keys = k_cache[pages, offsets].to(math)  # [seq_len, num_kv_heads, head_dim]
        values = v_cache[pages, offsets].to(math)
        keys = keys.repeat_interleave(group, dim=1)  # [seq_len, num_q_heads, head_dim]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[s].to(math), keys) * scale  # [num_q_heads, seq_len]
        out[s] = torch.einsum("hk,khd->hd", scores.softmax(dim=-1), values).to(q.dtype)
    return out


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,  # [S, Hq, D], or [S, Hq, splits, D] fp32 partials when SPLIT
    max_ptr,  # [S, Hq, splits] fp32 (SPLIT only)
    sum_ptr,  # [S, Hq, splits] fp32 (SPLIT only)
    scale,
    q_stride_t,
    q_stride_h,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    table_stride,
    group,
    head_dim,
    keys_per_split,  # a multiple of BLOCK_N
    SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (sequence, kv head, split): its ``group`` query heads over its keys."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    heads = kv_head * group + tl.arange(0, BLOCK_G)  # query heads of this kv head
    dims = tl.arange(0, BLOCK_D)
    head_ok = tl.arange(0, BLOCK_G) < group
    dim_ok = dims < head_dim
    q_offsets = seq * q_stride_t + heads[:, None] * q_stride_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    table_row = block_tables_ptr + seq * table_stride
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    split_start = split * keys_per_split
    split_end = tl.minimum(split_start + keys_per_split, seq_len)
    for tile_start in range(split_start, split_end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_ok = keys < split_end
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, table_row, keys, key_ok, kv_head * cache_stride_head,
            dims, dim_ok, cache_stride_block, cache_stride_slot, PAGE,
        )  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [G, BLOCK_N]
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out_mask = head_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        row = (seq * group * tl.num_programs(1) + heads) * num_splits + split  # [BLOCK_G]
        tl.store(max_ptr + row, m_i, mask=head_ok)
        tl.store(sum_ptr + row, l_i, mask=head_ok)
        tl.store(out_ptr + row[:, None] * head_dim + dims[None, :], acc, mask=out_mask)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,  # [S, Hq, splits, D] fp32
    max_ptr,  # [S, Hq, splits] fp32
    sum_ptr,
    out_ptr,  # [S, Hq, D]
    out_stride_t,
    out_stride_h,
    num_splits,
    head_dim,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Combine the per-split softmax partials of one (sequence, query head)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    row = (seq * tl.num_programs(1) + head) * num_splits + splits
    maxes = tl.load(max_ptr + row, mask=split_ok, other=float("-inf"))
    sums = tl.load(sum_ptr + row, mask=split_ok, other=0.0)
    mask = split_ok[:, None] & (dims < head_dim)[None, :]
    partial = tl.load(partial_ptr + row[:, None] * head_dim + dims[None, :], mask=mask, other=0.0)
    top = tl.max(maxes, axis=0)
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp(maxes - top))  # empty splits: 0
    out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(sums * weights, axis=0)
    out_offsets = seq * out_stride_t + head * out_stride_h + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_tiles: int, device: torch.device
) -> int:
    """Split the context only when (sequence, kv head) programs cannot fill the GPU; keep at
    least 2 key tiles per split."""
    if device.type != "cuda" or max_tiles < 4:
        return 1
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    return max(1, min(-(-2 * num_sms // programs), max_tiles // 2, 64))


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`decode_attention_torch` (one query token per sequence)."""
    require_triton()
    check_paged_inputs(q, k_cache, v_cache, block_tables)
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32
    assert block_tables.shape[0] == num_seqs
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    block_n = block_n or default_block_n(q.device)
    max_keys = block_tables.shape[1] * block_size
    if max_seq_len is not None:
        max_keys = min(max_keys, max_seq_len)
    max_tiles = triton.cdiv(max_keys, block_n)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_tiles, q.device)
    keys_per_split = triton.cdiv(max_tiles, num_splits) * block_n
    split = num_splits > 1
    shape = (num_seqs, num_q_heads, num_splits)
    partial = torch.empty(*shape, head_dim, dtype=torch.float32, device=q.device) if split else out
    maxes = torch.empty(shape, dtype=torch.float32, device=q.device) if split else out
    sums = torch.empty(shape, dtype=torch.float32, device=q.device) if split else out
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, partial, maxes, sums, scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), num_q_heads // num_kv_heads, head_dim, keys_per_split,
        SPLIT=split,
        BLOCK_G=max(16, triton.next_power_of_2(num_q_heads // num_kv_heads)),
        BLOCK_D=block_d,
        PAGE=block_size,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    if split:
        _merge_splits_kernel[(num_seqs, num_q_heads)](
            partial, maxes, sums, out, out.stride(0), out.stride(1), num_splits, head_dim,
            BLOCK_SPLITS=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )  # fmt: skip
    return out
