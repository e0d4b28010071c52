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


def decode_attention_triton(*args, **kwargs):  # type: ignore[no-untyped-def]
    """Triton kernel: not written yet."""
    require_triton()
    raise NotImplementedError("decode_attention_triton: Triton kernel not written yet")
