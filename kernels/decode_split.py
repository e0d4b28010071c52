"""The torch path for decode sequences (one query each) on the CPU, without copying whole
contexts.

During decode a sequence's pages are usually a run of consecutive block ids (its prompt's) plus
a scattered tail (one page per ``block_size`` generated tokens, interleaved with other requests).
The run is attended through a cache view and the tail through a slice of one packed gather of
every tail, each with one CPU flash call that passes the GQA query group as the query length (no
K/V head expansion) and returns its log-sum-exp; the two partial results merge by it.
"""

from dataclasses import dataclass

import torch

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass
class DecodeSplit:
    """Where each decode sequence's context lies: a leading run of pages, then a tail."""

    rows: torch.Tensor  # [n] int64 batch index of each decode sequence
    run_first_page: list[int]
    run_tokens: list[int]
    tail_tokens: list[int]
    tail_start: list[int]  # where each tail starts in the packed tail gather (in tokens)
    tail_pages: torch.Tensor  # [num_tail_pages] int64 block ids, sequence by sequence


def plan_decode_split(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    rows: torch.Tensor,  # [n] int64 which sequences are decodes
    block_size: int,
) -> tuple[DecodeSplit, torch.Tensor]:  # the split, and [m] rows left to the caller
    """Measure each leading run of consecutive block ids and list the tail pages (one host read).

    Sequences whose tail is longer than their run (scattered pages) are left out: one gather of
    their whole context and one attention call serve them better than two calls.
    """
    tables = block_tables[rows].long()  # [n, max_blocks]
    lens = seq_lens[rows].long()  # [n]
    used = (lens + block_size - 1) // block_size  # [n] pages holding the context
    steps = (tables[:, 1:] - tables[:, :-1] == 1).long()  # [n, max_blocks - 1]
    run_pages = torch.minimum(1 + steps.cumprod(dim=1).sum(dim=1), used)  # [n]
    run_tokens = torch.minimum(run_pages * block_size, lens)  # [n]
    keep = lens - run_tokens <= run_tokens
    if not bool(keep.all()):
        tables, lens, used = tables[keep], lens[keep], used[keep]
        run_pages, run_tokens = run_pages[keep], run_tokens[keep]
    tail_tokens = lens - run_tokens  # [n]
    tail_pages = used - run_pages  # [n]
    tail_start = (torch.cumsum(tail_pages, 0) - tail_pages) * block_size  # [n]
    host = torch.stack((tables[:, 0], run_tokens, tail_tokens, tail_start)).tolist()
    columns = torch.arange(tables.shape[1], device=tables.device)[None, :]  # [1, max_blocks]
    in_tail = (columns >= run_pages[:, None]) & (columns < used[:, None])  # [n, max_blocks]
    split = DecodeSplit(rows[keep], host[0], host[1], host[2], host[3], tables[in_tail])
    return split, rows[~keep]


def attend_runs(
    q: torch.Tensor,  # [n, num_kv_heads, group, head_dim] decode queries
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    split: DecodeSplit,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [n, num_kv_heads, group, head_dim], [n, kv, group]
    """Flash attention of each query group over its run, read as a view of the cache."""
    block_size = k_cache.shape[1]
    outs, lses = [], []
    for i, (first, tokens) in enumerate(zip(split.run_first_page, split.run_tokens, strict=True)):
        pages = slice(first, first + -(-tokens // block_size))
        # [1, num_kv_heads, tokens, head_dim] strided views of the run
        k, v = (c[pages].flatten(0, 1)[:tokens].transpose(0, 1)[None] for c in (k_cache, v_cache))
        out, lse = _flash_cpu(q[i : i + 1], k, v, scale=scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def attend_tails(
    q: torch.Tensor,  # [n, num_kv_heads, group, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    split: DecodeSplit,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [n, num_kv_heads, group, head_dim], [n, kv, group]
    """Flash attention of each query group over its tail, a slice of one packed gather; an
    empty tail gives output 0 and log-sum-exp -inf (it then weighs nothing in the merge)."""
    # [num_tail_pages * block_size, num_kv_heads, head_dim] each
    k, v = (c.index_select(0, split.tail_pages).flatten(0, 1) for c in (k_cache, v_cache))
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
    for i, (start, tokens) in enumerate(zip(split.tail_start, split.tail_tokens, strict=True)):
        if tokens:
            keys = slice(start, start + tokens)
            # [1, num_kv_heads, tokens, head_dim] strided views of the packed tail
            k_i, v_i = (t[keys].transpose(0, 1)[None] for t in (k, v))
            out[i : i + 1], lse[i : i + 1] = _flash_cpu(q[i : i + 1], k_i, v_i, scale=scale)
    return out, lse


def decode_attention_torch(
    q: torch.Tensor,  # [n, num_q_heads, head_dim] one query per decode sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    split: DecodeSplit,
    scale: float,
) -> torch.Tensor:  # [n, num_q_heads, head_dim]
    """Attention of each decode query over its whole context: run and tail merged by LSE."""
    n, num_q_heads, head_dim = q.shape
    grouped = q.view(n, k_cache.shape[2], -1, head_dim)  # query head h reads kv head h // group
    run_out, run_lse = attend_runs(grouped, k_cache, v_cache, split, scale)
    if not any(split.tail_tokens):
        return run_out.view(n, num_q_heads, head_dim)
    tail_out, tail_lse = attend_tails(grouped, k_cache, v_cache, split, scale)
    run_weight = torch.sigmoid(run_lse - tail_lse)[..., None]  # share of the run's keys
    merged = torch.lerp(tail_out.float(), run_out.float(), run_weight)
    return merged.to(q.dtype).view(n, num_q_heads, head_dim)
