"""Attention over one flattened batch of prefill chunks and decodes (no padding).

The keys and values of this step's tokens must already be in the cache (``write_kv`` first).
The torch path attends fp32 decodes on the CPU with two sparse-dense products for the whole
batch (``sparse_decode``) and every other sequence with one SDPA over a view or one packed
gather; the Triton path runs the decode kernel for an all-decode batch and the varlen kernel
otherwise (it handles decodes too).
"""

import torch

from shoal.kernels.decode_attention import decode_attention_triton
from shoal.kernels.varlen_attention import (
    TorchAttentionPlan,
    plan_varlen_torch,
    varlen_attention_torch,
    varlen_attention_triton,
)


def paged_attention_torch(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    plan: TorchAttentionPlan | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Torch reference (the length hints are not needed: it reads the lengths on the host);
    ``plan`` from ``plan_paged_attention_torch`` spares re-planning in every layer."""
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    return varlen_attention_torch(*args, scale, plan)


def plan_paged_attention_torch(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> TorchAttentionPlan:
    """The torch path's plan for a batch, valid for every layer with the same cache shape."""
    return plan_varlen_torch(block_tables, query_start_loc, seq_lens, k_cache, q.shape[1])


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Triton path: the decode kernel when every query length is 1, else the varlen kernel."""
    if max_query_len is None:
        max_query_len = (
            int((query_start_loc[1:] - query_start_loc[:-1]).max()) if len(seq_lens) else 0
        )
    if max_query_len <= 1:
        return decode_attention_triton(
            q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=max_seq_len
        )
    return varlen_attention_triton(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len
    )
