"""The torch path for decode queries on the CPU: the whole batch's decodes in two sparse-dense
products over the cache, with no context copied and no call per sequence.

The scores form a sparse matrix: one row per (decode sequence, query head), one column per
(cache slot, kv head) of the cache seen as ``[num_slots * num_kv_heads, head_dim]``; a row holds
the slots of its sequence's context under its kv head. ``sampled_addmm`` computes QKᵀ at those
entries only, a softmax runs over each row's values, and a CSR @ dense product sums P·V. Both
products stream the keys and values once, so a step costs about its context bytes, whatever the
page layout or the number of sequences. fp32/fp64 only (the sampled product's dtypes).
"""

import warnings
from dataclasses import dataclass

import torch

# the sparse CSR layout warns once that it is beta; these ops are covered by the kernel tests
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")

SPARSE_DTYPES = (torch.float32, torch.float64)
MIN_EXPONENT = -80.0  # exp(-80) ~ 1.8e-35, still a normal fp32 number


@dataclass(frozen=True)
class DecodePattern:
    """Which cache entries each decode query head reads; built once per step, used per layer."""

    token_rows: torch.Tensor  # [n] int64, the query token of each decode in the flat batch
    where: torch.Tensor  # [n * num_q_heads, num_columns] sparse CSR of zeros: the pattern
    row_lens: torch.Tensor  # [n * num_q_heads] int64 keys per row
    entry_rows: torch.Tensor  # [nnz] int64 the row of each entry


def plan_decode_pattern(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    decodes: torch.Tensor,  # [n] int64 batch index of each decode sequence
    token_rows: torch.Tensor,  # [n] int64 its query token
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    num_q_heads: int,
) -> DecodePattern:
    """The sparse pattern of a batch's decodes (one host read: the longest context)."""
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    num_columns = num_blocks * block_size * num_kv_heads
    device = block_tables.device
    tables = block_tables[decodes].long()  # [n, max_blocks]
    lens = seq_lens[decodes].long()  # [n]
    positions = torch.arange(int(lens.max()), device=device)  # [width]
    pages = tables.index_select(1, positions // block_size)  # [n, width]
    visible = positions[None, :] < lens[:, None]  # [n, width]
    slots = (pages * block_size + positions % block_size).masked_select(visible)  # [tokens]
    # row (sequence i, query head h) holds sequence i's slots, as columns of kv head h // group
    row_lens = lens.repeat_interleave(num_q_heads)  # [rows]
    crow = torch.zeros(len(row_lens) + 1, dtype=torch.int64, device=device)
    torch.cumsum(row_lens, 0, out=crow[1:])
    first_token = (torch.cumsum(lens, 0) - lens).repeat_interleave(num_q_heads)  # [rows]
    kv_head = torch.arange(num_q_heads, device=device) // (num_q_heads // num_kv_heads)
    rows = torch.arange(len(row_lens), device=device)
    per_row = torch.stack((first_token - crow[:-1], kv_head.repeat(len(lens)), rows))
    token_shift, head, entry_rows = _spread_rows(per_row, crow)  # [nnz] each
    token = token_shift.add_(torch.arange(len(token_shift), device=device))  # into slots
    col = slots.index_select(0, token).mul_(num_kv_heads).add_(head)  # row by row
    index = torch.int32 if max(num_columns, len(col)) < 2**31 else torch.int64
    crow, col = crow.to(index), col.to(index)
    where = torch.sparse_csr_tensor(
        crow, col, torch.zeros(len(col), dtype=k_cache.dtype, device=col.device),
        (len(row_lens), num_columns), check_invariants=False,
    )  # fmt: skip
    return DecodePattern(token_rows, where, row_lens, entry_rows)


def _spread_rows(per_row: torch.Tensor, crow: torch.Tensor) -> torch.Tensor:
    """``[k, rows]`` values → ``[k, nnz]``, each row's value repeated over its entries (rows are
    not empty): differences dropped at the row starts, then a running sum, with no gather."""
    deltas = per_row.new_zeros(per_row.shape[0], int(crow[-1]))
    deltas[:, crow[:-1]] = torch.diff(per_row, dim=1, prepend=torch.zeros_like(per_row[:, :1]))
    return deltas.cumsum_(dim=1)


def sparse_decode_attention(
    q: torch.Tensor,  # [T, num_q_heads, head_dim], the whole flattened batch
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    pattern: DecodePattern,
    scale: float,
) -> torch.Tensor:  # [n, num_q_heads, head_dim], the decodes' outputs in pattern order
    """Softmax(QKᵀ·scale)·V of every decode query over its context, sampled at the pattern."""
    where, head_dim = pattern.where, q.shape[2]
    num_rows, num_columns = where.shape
    queries = q.index_select(0, pattern.token_rows).view(num_rows, head_dim)
    keys = k_cache.view(num_columns, head_dim)
    scores = torch.sparse.sampled_addmm(where, queries, keys.t(), beta=0.0, alpha=scale).values()
    row_max = scores.new_full((num_rows,), float("-inf"))  # scatter: 2x segment_reduce's speed
    row_max.scatter_reduce_(0, pattern.entry_rows, scores, "amax")
    shift = row_max.index_select(0, pattern.entry_rows)
    # unnormalised probabilities; exponents are floored where exp would leave fp32's normal
    # range: denormal weights slow exp and the product ~30x, and weigh < 1e-30 of a row's sum
    weights = scores.sub_(shift).clamp_(min=MIN_EXPONENT).exp_()
    denominators = torch.segment_reduce(weights, "sum", lengths=pattern.row_lens, unsafe=True)
    probs = torch.sparse_csr_tensor(
        where.crow_indices(), where.col_indices(), weights, where.shape, check_invariants=False
    )
    out = probs @ v_cache.view(num_columns, head_dim)  # [rows, head_dim]
    return out.div_(denominators[:, None]).view(len(pattern.token_rows), -1, head_dim)
