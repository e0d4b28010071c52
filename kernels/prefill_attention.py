"""Paged varlen attention for prefill chunks over a cached prefix: torch reference and Triton.

A sequence's queries are its last ``query_len`` positions of ``seq_len``; query ``i`` attends to
keys ``0 .. seq_len - query_len + i`` (a bottom-right-aligned causal mask).
"""

import torch
import torch.nn.functional as F

from kernels._triton import require_triton, tl, triton


def prefill_attention_one_torch(
    q: torch.Tensor,  # [query_len, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [query_len, num_q_heads, head_dim]
    """Attention of one sequence's query chunk over its gathered context, with SDPA."""
    query_len = q.shape[0]
    block_size = k_cache.shape[1]
    pages = block_table[: -(-seq_len // block_size)].long()
    keys = k_cache[pages].flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
    values = v_cache[pages].flatten(0, 1)[:seq_len]
    q_h, k_h, v_h = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(
            q_h, k_h, v_h, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        query_pos = seq_len - query_len + torch.arange(query_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(
            q_h, k_h, v_h, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out.transpose(0, 1)


def prefill_attention_triton(*args, **kwargs):  # type: ignore[no-untyped-def]
    """Triton kernel: not written yet."""
    require_triton()
    raise NotImplementedError("prefill_attention_triton: Triton kernel not written yet")
