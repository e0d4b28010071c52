"""The torch path for decode queries on the CPU: the whole batch's decodes in two sparse-dense
products over the cache, with no context copied and no call per sequence.

The scores form a sparse matrix with one column per (cache slot, kv head) of the cache seen as
``[num_slots * num_kv_heads, head_dim]`` and one row per (chunk of a sequence's context, query
head), holding the chunk's slots under the head's kv head. ``sampled_addmm`` computes QKᵀ at
those entries only, a softmax runs over each query's entries (all its chunks), and a CSR @
dense product sums P·V per chunk, added up per query. The products read the keys and values
about once, so a step costs about its context bytes, whatever the page layout or the number of
sequences. fp32/fp64 only (the sampled product's dtypes).
"""

import warnings
from dataclasses import dataclass

import torch

# the sparse CSR layout warns once that it is beta; these ops are covered by the kernel tests
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")

SPARSE_DTYPES = (torch.float32, torch.float64)
MIN_EXPONENT = -80.0  # exp(-80) ~ 1.8e-35, still a normal fp32 number
CHUNK_BYTES = 256 * 1024  # K bytes per chunk of a context: its rows stay in the L2 cache


@dataclass(frozen=True)
class DecodePattern:
    """Which cache entries each decode query head reads; built once per step, used per layer.

    Each context is cut into chunks of a few pages and a row is one (chunk, query head): the
    rows of a chunk are adjacent, so the query heads sharing a kv head find its keys in the L2
    cache instead of streaming them from memory once per head."""

    token_rows: torch.Tensor  # [n] int64, the query token of each decode in the flat batch
    where: torch.Tensor  # [rows, num_columns] sparse CSR of zeros: the pattern
    row_lens: torch.Tensor  # [rows] int64 keys per row
    row_query: torch.Tensor  # [rows] int64 which (decode, query head) a row serves
    entry_query: torch.Tensor  # [nnz] int64 the same for each entry


def plan_decode_pattern(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    decodes: torch.Tensor,  # [n] int64 batch index of each decode sequence
    token_rows: torch.Tensor,  # [n] int64 its query token
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    num_q_heads: int,
) -> DecodePattern:
    """The sparse pattern of a batch's decodes, in memory linear in its entries (a few host
    reads: the sizes of the index arrays)."""
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    device = block_tables.device
    lens = seq_lens[decodes].long()  # [n]
    first_token = torch.cumsum(lens, 0) - lens  # [n] where each context starts in ``slots``
    slots = _context_slots(block_tables[decodes], lens, first_token, block_size)  # [tokens]
    chunk_seq, chunk_offset, chunk_lens = _cut_into_chunks(lens, _keys_per_chunk(k_cache))
    # rows chunk by chunk, query head by query head; head h reads kv head h // group
    heads = torch.arange(num_q_heads, device=device)
    row_lens = chunk_lens.repeat_interleave(num_q_heads)  # [rows]
    row_query = (chunk_seq[:, None] * num_q_heads + heads).flatten()  # [rows]
    row_first = (first_token[chunk_seq] + chunk_offset).repeat_interleave(num_q_heads)
    row_kv_head = (heads // (num_q_heads // num_kv_heads)).repeat(len(chunk_seq))
    crow = torch.zeros(len(row_lens) + 1, dtype=torch.int64, device=device)
    torch.cumsum(row_lens, 0, out=crow[1:])
    per_row = torch.stack((row_first - crow[:-1], row_kv_head, row_query))  # [3, rows]
    token_shift, kv_head, entry_query = _spread_rows(per_row, crow)  # [nnz] each
    token = token_shift.add_(torch.arange(len(token_shift), device=device))  # into slots
    col = slots.index_select(0, token).mul_(num_kv_heads).add_(kv_head)  # row by row
    num_columns = num_blocks * block_size * num_kv_heads
    index = torch.int32 if max(num_columns, len(col)) < 2**31 else torch.int64
    where = torch.sparse_csr_tensor(
        crow.to(index), col.to(index), torch.zeros(len(col), dtype=k_cache.dtype, device=device),
        (len(row_lens), num_columns), check_invariants=False,
    )  # fmt: skip
    return DecodePattern(token_rows, where, row_lens, row_query, entry_query)


def _context_slots(
    tables: torch.Tensor,  # [n, max_blocks] int32
    lens: torch.Tensor,  # [n] int64
    first_token: torch.Tensor,  # [n] int64
    block_size: int,
) -> torch.Tensor:  # [sum(lens)] int64 cache slot of every context token, sequence by sequence
    seq = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
    position = torch.arange(len(seq), device=lens.device) - first_token[seq]
    pages = tables.long().flatten()[seq * tables.shape[1] + position // block_size]
    return pages * block_size + position % block_size


def _cut_into_chunks(
    lens: torch.Tensor,  # [n] int64 context lengths
    keys_per_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [chunks] each
    """Each context cut into chunks of ``keys_per_chunk`` keys (the last one shorter): every
    chunk's sequence, first key and length."""
    chunks = (lens + keys_per_chunk - 1) // keys_per_chunk  # [n]
    seq = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), chunks)
    first_of_seq = (torch.cumsum(chunks, 0) - chunks)[seq]
    offset = (torch.arange(len(seq), device=lens.device) - first_of_seq) * keys_per_chunk
    return seq, offset, torch.clamp(lens[seq] - offset, max=keys_per_chunk)


def _keys_per_chunk(k_cache: torch.Tensor) -> int:
    """Keys whose K rows (all kv heads) fill CHUNK_BYTES, in whole pages (at least one)."""
    block_size = k_cache.shape[1]
    bytes_per_key = k_cache[0, 0].numel() * k_cache.element_size()
    return max(1, CHUNK_BYTES // (bytes_per_key * block_size)) * block_size


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
    where, (_, num_q_heads, head_dim) = pattern.where, q.shape
    num_columns = where.shape[1]
    assert num_columns * head_dim == k_cache.numel(), "the plan was made for another cache"
    num_queries = len(pattern.token_rows) * num_q_heads
    queries = q.index_select(0, pattern.token_rows).view(num_queries, head_dim)
    keys = k_cache.view(num_columns, head_dim)
    row_queries = queries.index_select(0, pattern.row_query)  # [rows, head_dim]
    scores = torch.sparse.sampled_addmm(where, row_queries, keys.t(), beta=0.0, alpha=scale)
    scores = scores.values()  # [nnz]
    query_max = scores.new_full((num_queries,), float("-inf"))
    query_max.scatter_reduce_(0, pattern.entry_query, scores, "amax")
    # unnormalised probabilities; exponents are floored where exp would leave fp32's normal
    # range: denormal weights slow exp and the product ~30x, and weigh < 1e-30 of a query's sum
    shift = query_max.index_select(0, pattern.entry_query)
    weights = scores.sub_(shift).clamp_(min=MIN_EXPONENT).exp_()
    row_sums = torch.segment_reduce(weights, "sum", lengths=pattern.row_lens, unsafe=True)
    probs = torch.sparse_csr_tensor(
        where.crow_indices(), where.col_indices(), weights, where.shape, check_invariants=False
    )
    partial = probs @ v_cache.view(num_columns, head_dim)  # [rows, head_dim], per chunk
    out = partial.new_zeros(num_queries, head_dim).index_add_(0, pattern.row_query, partial)
    sums = row_sums.new_zeros(num_queries).index_add_(0, pattern.row_query, row_sums)
    return out.div_(sums[:, None]).view(-1, num_q_heads, head_dim)
