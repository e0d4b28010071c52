"""Paged attention for decode steps (one query token per sequence): torch reference and Triton.

Each sequence's context is its first ``seq_len`` cache slots, read through its block table; the
single query sits at the last position, so it attends to the whole context.
"""

import torch

from kernels._triton import require_triton, tl, triton


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs]
    num_context_blocks: int,
) -> torch.Tensor:  # [num_seqs, num_context_blocks * block_size, num_kv_heads, head_dim]
    """Gather each sequence's first pages; table entries past a sequence's pages are ignored."""
    block_size = cache.shape[1]
    table = block_tables[:, :num_context_blocks].long()  # [num_seqs, num_context_blocks]
    pages_used = (seq_lens.long() + block_size - 1) // block_size  # [num_seqs]
    columns = torch.arange(num_context_blocks, device=table.device)
    table = torch.where(columns[None, :] < pages_used[:, None], table, 0)
    gathered = cache[table]  # [num_seqs, num_context_blocks, block_size, num_kv_heads, head_dim]
    return gathered.flatten(1, 2)


def decode_attention_torch(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """One batched gather and one masked softmax for a whole batch of decodes (fp32 math)."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if num_seqs else 0
    num_context_blocks = -(-max_seq_len // block_size)
    keys = gather_context(k_cache, block_tables, seq_lens, num_context_blocks).float()
    values = gather_context(v_cache, block_tables, seq_lens, num_context_blocks).float()
    context_len = keys.shape[1]
    # [num_seqs, num_kv_heads, group, head_dim] x [num_seqs, num_kv_heads, head_dim, context_len]
    q_grouped = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(q_grouped, keys.permute(0, 2, 3, 1)) * scale
    positions = torch.arange(context_len, device=q.device)
    beyond = positions[None, :] >= seq_lens.to(q.device).long()[:, None]  # [num_seqs, context_len]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(
        probs, values.permute(0, 2, 1, 3)
    )  # [num_seqs, num_kv_heads, group, head_dim]
    return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)


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


def check_paged_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> None:
    """Shape, stride and dtype checks shared by the paged attention kernels."""
    assert q.dim() == 3 and q.is_contiguous(), f"q must be [T, heads, dim], got {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "k/v caches differ in shape"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert q.shape[2] == k_cache.shape[3], f"head_dim {q.shape[2]} != cache {k_cache.shape[3]}"
    assert q.shape[1] % k_cache.shape[2] == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert q.dtype == k_cache.dtype == v_cache.dtype, f"{q.dtype} vs cache {k_cache.dtype}"
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert k_cache.shape[1] >= 16 and k_cache.shape[1] & (k_cache.shape[1] - 1) == 0, (
        "block_size must be a power of two >= 16 for the Triton kernels"
    )


def dot_precision(dtype: torch.dtype) -> str:
    """Exact fp32 products for fp32 inputs (no TF32); the default for half types."""
    return "ieee" if dtype == torch.float32 else "tf32"


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
