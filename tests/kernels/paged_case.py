"""Builds random paged attention cases (ragged lengths, shuffled pages, garbage table entries)
and a naive dense attention to check them against."""

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, num_q_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    dense_k: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    dense_v: list[torch.Tensor]
    scale: float


def make_paged_case(
    query_lens: list[int],
    context_lens: list[int],
    num_kv_heads: int,
    gqa: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    shuffle_pages: bool = True,
    tail_pages: int = 0,
) -> PagedCase:
    """Each sequence has ``context_lens[i]`` cached tokens then ``query_lens[i]`` new ones.

    Pages are drawn at random (or, without ``shuffle_pages``, in consecutive runs) from a pool
    with spare pages filled with garbage; table entries past a sequence's pages hold
    out-of-range garbage ids (holes the kernels must not read). With ``tail_pages`` (and
    consecutive runs), each sequence's last pages, up to that many, are scattered through the
    pool after every run, as decode growth interleaved across requests leaves them.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    pages_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(pages_per_seq) + 2
    num_blocks = sum(pages_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 5
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 5
    page_lists = _page_lists(pages_per_seq, num_blocks, shuffle_pages, tail_pages, gen)
    block_tables = torch.full((len(seq_lens), max_blocks), 10_000, dtype=torch.int32)
    dense_k, dense_v = [], []
    for s, n in enumerate(seq_lens):
        pages = page_lists[s]
        block_tables[s, : len(pages)] = pages.to(torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        slots = (pages[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        dense_k.append(k.to(dtype))
        dense_v.append(v.to(dtype))
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    q = torch.randn(int(starts[-1]), num_kv_heads * gqa, head_dim, generator=gen).to(dtype)
    return PagedCase(
        q=q,
        k_cache=k_cache.to(dtype),
        v_cache=v_cache.to(dtype),
        block_tables=block_tables,
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        dense_k=dense_k,
        dense_v=dense_v,
        scale=head_dim**-0.5,
    )


def _page_lists(
    pages_per_seq: list[int],
    num_blocks: int,
    shuffle: bool,
    tail_pages: int,
    gen: torch.Generator,
) -> list[torch.Tensor]:  # per sequence [pages] int64 block ids
    """Block ids per sequence: shuffled, or consecutive runs then scattered tails."""
    perm = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
    tails = [min(tail_pages, n - 1) for n in pages_per_seq]
    runs, taken = [], 0
    for n, tail in zip(pages_per_seq, tails, strict=True):
        runs.append(perm[taken : taken + n - tail])
        taken += n - tail
    rest = perm[taken:][torch.randperm(num_blocks - taken, generator=gen)]
    lists = []
    for run, tail in zip(runs, tails, strict=True):
        lists.append(torch.cat((run, rest[:tail])))
        rest = rest[tail:]
    return lists


def naive_attention(case: PagedCase) -> torch.Tensor:  # [T, num_q_heads, head_dim]
    """Dense per-sequence, per-head attention with an explicit causal loop-free mask (fp64)."""
    out = torch.empty_like(case.q)
    starts = case.query_start_loc.tolist()
    gqa = case.q.shape[1] // case.dense_k[0].shape[1]
    for s, (k, v) in enumerate(zip(case.dense_k, case.dense_v, strict=True)):
        q = case.q[starts[s] : starts[s + 1]].double()  # [query_len, num_q_heads, head_dim]
        seq_len, query_len = k.shape[0], q.shape[0]
        k_rep = k.double().repeat_interleave(gqa, dim=1)  # [seq_len, num_q_heads, head_dim]
        v_rep = v.double().repeat_interleave(gqa, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k_rep) * case.scale
        query_pos = torch.arange(query_len) + seq_len - query_len
        allowed = torch.arange(seq_len)[None, :] <= query_pos[:, None]  # [query_len, seq_len]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = scores.softmax(-1)
        out[starts[s] : starts[s + 1]] = torch.einsum("hqk,khd->qhd", probs, v_rep).to(out.dtype)
    return out
