"""Paged varlen attention over one flattened batch of any mix of prefill chunks and decodes:
the torch path (planned once per step; fp32 decodes on the CPU handed to ``sparse_decode``; bf16
prompt runs to the AMX prefill kernel where the CPU has one) and the Triton varlen kernel.

A sequence's queries are its last ``query_len`` positions of ``seq_len``; query ``i`` attends to
keys ``0 .. seq_len - query_len + i`` (a bottom-right-aligned causal mask).
"""

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal.kernels._backend import use_cpu_kernels
from shoal.kernels._triton import require_triton, tl, triton
from shoal.kernels.cpu_decode_attention import (
    CpuDecodePlan,
    cpu_decode_attention,
    cpu_decode_available,
    plan_cpu_decode,
    plan_cpu_decodes_in_order,
)
from shoal.kernels.cpu_prefill_attention import (
    CpuPrefillPlan,
    cpu_prefill_attention,
    cpu_prefill_available,
    plan_cpu_prefill,
)
from shoal.kernels.paged_common import (
    ContextReads,
    check_paged_inputs,
    default_block_n,
    dot_precision,
    load_kv_tile,
    plan_context_reads,
    read_contexts,
)
from shoal.kernels.sparse_decode import (
    SPARSE_DTYPES,
    DecodePattern,
    plan_decode_pattern,
    sparse_decode_attention,
)

# Longer runs of queries (long prompts' chunks) go to SDPA. Shorter ones (drafts being verified,
# short prompts) take the C kernel a query at a time: a step of 64 prompts of 45-195 tokens
# prefilled ~3% faster that way than by an SDPA per sequence (8 x 128 and 1 x 1000 even), on a
# CPU without matrix units.
MAX_KERNEL_QUERY_LEN = 256
# Where torch's SDPA multiplies bf16 on the matrix units (AMX), it wins on longer prompts: 64
# prompts of 128 tokens prefilled at ~3,300-3,700 tokens/s against ~3,050-3,250 in the kernel on
# a 2-core Xeon, prompts of 32 and 64 tokens about even, so those stay in the kernel (the
# README's 37-token question to the default model is a near-tie in bf16 at its first token,
# which the two paths' roundings answer differently: "The capital..." and "L'Étoile...").
MAX_KERNEL_QUERY_LEN_AMX = 64
# Where shoal's own prefill kernel runs on the matrix units (cpu_prefill_attention), it takes
# every run of more than 8 queries: 16 runs of 16 queries 0.15 -> 0.10 ms a layer against the
# decode kernel a query at a time, of 64 queries 1.25 -> 0.30 (8: 0.08 either way), and 16 x 128
# 2.7 -> 1.0 ms against an SDPA per sequence (2-core Xeon). The README's question answers "The
# capital..." through it.
MAX_KERNEL_QUERY_LEN_PREFILL = 8
# Except in a step the decode kernel could take whole (no run past 64) with few prompt queries:
# such a step runs each layer's rotary, KV write and attention as one C call, or all its layers
# as one (cpu_decode_step, cpu_decoder_layers), which saves more than the prefill kernel would
# (one 37-token prompt of the default model's GGUF: TTFT 17 ms that way, 23 through the prefill
# kernel). The decode kernel's extra time grows with the runs' squares: 256 queries in runs of
# 32 cost ~4 ms more a step than the prefill kernel, in runs of 64 ~6.
MAX_ONE_CALL_PROMPT_QUERIES = 256


def max_kernel_query_len(k_cache: torch.Tensor, num_q_heads: int, query_lens: torch.Tensor) -> int:
    """The longest run of queries the C decode kernel takes over this cache on this CPU, in a
    step with these runs ([num_seqs])."""
    bf16_on_amx = k_cache.dtype == torch.bfloat16 and _torch_has_amx()
    if cpu_prefill_available(k_cache, num_q_heads) and not _one_call_step(query_lens):
        return MAX_KERNEL_QUERY_LEN_PREFILL
    return MAX_KERNEL_QUERY_LEN_AMX if bf16_on_amx else MAX_KERNEL_QUERY_LEN


def _one_call_step(query_lens: torch.Tensor) -> bool:
    """No run past MAX_KERNEL_QUERY_LEN_AMX, and MAX_ONE_CALL_PROMPT_QUERIES at most in the
    runs the prefill kernel would take."""
    prompts = query_lens[query_lens > MAX_KERNEL_QUERY_LEN_PREFILL]
    if not len(prompts):
        return True
    longest, total = int(prompts.max()), int(prompts.sum())
    return longest <= MAX_KERNEL_QUERY_LEN_AMX and total <= MAX_ONE_CALL_PROMPT_QUERIES


@functools.cache
def _torch_has_amx() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def attend_one_sequence(
    q: torch.Tensor,  # [query_len, num_q_heads, head_dim]
    keys: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    values: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [query_len, num_q_heads, head_dim]
    """SDPA of one sequence's queries (its last positions) over its context."""
    query_len, seq_len = q.shape[0], keys.shape[0]
    # [1, heads, len, head_dim] views: SDPA's CPU kernels are much faster with a batch dim
    q_h, k_h, v_h = (t.transpose(0, 1)[None] for t in (q, keys, values))
    mask = None
    if 1 < query_len < seq_len:
        query_pos = seq_len - query_len + torch.arange(query_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q_h,
        k_h,
        v_h,
        attn_mask=mask,
        is_causal=1 < query_len == seq_len,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


@dataclass(frozen=True)
class TorchAttentionPlan:
    """How the torch path attends one step's batch: the same for every layer of the step."""

    # decode queries: the C kernel (CPU), else the sparse products (fp32 on CPU), else SDPA
    decode: CpuDecodePlan | DecodePattern | None
    seqs: list[int]  # every other sequence with queries (batch index)
    query_starts: list[int]  # query_start_loc on the host
    reads: ContextReads | None  # where the contexts of ``seqs`` lie (one SDPA each)
    prefill: CpuPrefillPlan | None = None  # or ``seqs`` in one call of the AMX kernel


def plan_varlen_torch(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    num_q_heads: int,
) -> TorchAttentionPlan:
    """Split the batch into decodes (the C kernel or the sparse products, on the CPU) and the
    other runs of queries: one call of the AMX prefill kernel where it serves the cache
    (``cpu_prefill_available``), else per-sequence SDPAs (a few host reads). The C decode kernel
    also takes short runs of queries (``max_kernel_query_len``: drafts being verified, short
    prompts), one query at a time."""
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [num_seqs]
    kernel = use_cpu_kernels() and cpu_decode_available(k_cache, num_q_heads)
    if kernel and len(seq_lens) and bool((query_lens == 1).all()):  # every sequence decodes
        in_order = plan_cpu_decodes_in_order(block_tables, seq_lens, num_q_heads, k_cache.shape[2])
        return TorchAttentionPlan(in_order, [], [], None)
    decode: CpuDecodePlan | DecodePattern | None = None
    if kernel:
        limit = max_kernel_query_len(k_cache, num_q_heads, query_lens)
        short = (query_lens > 0) & (query_lens <= limit)
        if bool(short.any()):
            args = (block_tables, query_start_loc, seq_lens, short, k_cache, num_q_heads)
            decode = plan_short_queries(*args)
        query_lens = torch.where(short, 0, query_lens)
    elif k_cache.device.type == "cpu" and k_cache.dtype in SPARSE_DTYPES:
        decodes = (query_lens == 1).nonzero()[:, 0]  # [n] int64
        if len(decodes):
            token_rows = query_start_loc[decodes].long()
            args = (block_tables, seq_lens, decodes, token_rows, k_cache, num_q_heads)
            decode = plan_decode_pattern(*args)
        query_lens = torch.where(query_lens == 1, 0, query_lens)
    others = (query_lens > 0).nonzero()[:, 0]  # [m] int64
    reads, prefill = None, None
    if len(others) and cpu_prefill_available(k_cache, num_q_heads):
        prefill = plan_cpu_prefill(block_tables, query_start_loc, seq_lens, others)
    elif len(others):
        lengths = seq_lens[others].tolist()
        reads = plan_context_reads(block_tables[others], lengths, k_cache.shape[1])
    elif isinstance(decode, CpuDecodePlan):  # the kernel takes every query, in batch order
        decode = dataclasses.replace(decode, in_order=True)
    return TorchAttentionPlan(decode, others.tolist(), query_start_loc.tolist(), reads, prefill)


def plan_short_queries(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    short: torch.Tensor,  # [num_seqs] bool: the sequences the C kernel takes
    k_cache: torch.Tensor,
    num_q_heads: int,
) -> CpuDecodePlan:
    """The C kernel's plan for every query of the ``short`` sequences: query ``i`` of a
    sequence with ``query_len`` queries sees ``seq_len - query_len + 1 + i`` keys."""
    seqs = short.nonzero()[:, 0]  # [s] int64
    counts = (query_start_loc[seqs + 1] - query_start_loc[seqs]).long()  # [s]
    num_kv_heads = k_cache.shape[2]
    if int(counts.max()) == 1:  # decodes only (the common step): one query each, no expansion
        token_rows = query_start_loc[seqs].long()
        return plan_cpu_decode(
            block_tables, seqs, token_rows, seq_lens[seqs], num_q_heads, num_kv_heads
        )
    owner = seqs.repeat_interleave(counts)  # [n] each query's sequence
    first_of_owner = (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
    index = torch.arange(len(owner)) - first_of_owner  # [n] the query's index in its sequence
    token_rows = query_start_loc[owner].long() + index
    key_lens = seq_lens[owner] - counts.repeat_interleave(counts) + 1 + index
    return plan_cpu_decode(block_tables, owner, token_rows, key_lens, num_q_heads, num_kv_heads)


def varlen_attention_torch(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    plan: TorchAttentionPlan | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Torch reference: fp32 decodes on the CPU through ``sparse_decode`` (two sparse-dense
    products for all of them); every other sequence in one call of the AMX prefill kernel
    (bf16, where the CPU has matrix units), else its context as a cache view (consecutive
    pages) or a slice of one packed gather, with one SDPA each. ``plan`` (from
    ``plan_varlen_torch``) is reused across layers; made here when not given.

    (Measured on the CPU, per-sequence SDPA beats a padded batched gather + masked matmul 3-6x
    for prefill and mixed batches: no padding, no layout copies.)
    """
    if plan is None:
        plan = plan_varlen_torch(block_tables, query_start_loc, seq_lens, k_cache, q.shape[1])
    decode = plan.decode
    if isinstance(decode, CpuDecodePlan) and decode.in_order and len(decode.token_rows) == len(q):
        return cpu_decode_attention(q, k_cache, v_cache, decode, scale)  # every row a decode
    out = torch.empty_like(q)
    if isinstance(decode, CpuDecodePlan):
        decoded = cpu_decode_attention(q, k_cache, v_cache, decode, scale)
        out.index_copy_(0, decode.token_rows, decoded)
    elif decode is not None:
        decoded = sparse_decode_attention(q, k_cache, v_cache, decode, scale)
        out.index_copy_(0, decode.token_rows, decoded)
    prefill = plan.prefill
    if prefill is not None and not cpu_prefill_attention(q, k_cache, v_cache, prefill, scale, out):
        lengths = prefill.seq_lens.tolist()  # the kernel declined (no buffers): SDPA after all
        reads = plan_context_reads(prefill.block_tables, lengths, k_cache.shape[1])
        plan = dataclasses.replace(plan, reads=reads)
    if plan.reads is not None:
        attend_sequences_torch(q, k_cache, v_cache, plan, scale, out)
    return out


def attend_sequences_torch(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], written in place
) -> None:
    """One SDPA per planned sequence over its context (a view or a slice of one gather)."""
    assert plan.reads is not None
    keys, values = read_contexts(k_cache, plan.reads), read_contexts(v_cache, plan.reads)
    starts = plan.query_starts
    for i, s in enumerate(plan.seqs):
        begin, end = starts[s], starts[s + 1]
        out[begin:end] = attend_one_sequence(q[begin:end], keys[i], values[i], scale)


@triton.jit
def _varlen_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (query tile, sequence, query head), streaming the keys it may see."""
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M < query_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - query_len
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
        dims = tl.arange(0, BLOCK_D)
        row_ok = rows < query_len
        dim_ok = dims < head_dim
        q_offsets = (q_start + rows)[:, None].to(tl.int64) * q_stride_t + head * q_stride_h
        q_mask = row_ok[:, None] & dim_ok[None, :]
        q = tl.load(q_ptr + q_offsets + dims[None, :], mask=q_mask, other=0.0)
        kv_end = context_len + tl.minimum(query_len, (tile + 1) * BLOCK_M)
        query_pos = context_len + rows  # absolute position of each query
        kv_head = head // group
        table_row = block_tables_ptr + seq * table_stride
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for tile_start in range(0, kv_end, BLOCK_N):
            key_pos = tile_start + tl.arange(0, BLOCK_N)
            k, v = load_kv_tile(
                k_cache_ptr, v_cache_ptr, table_row, key_pos, key_pos < kv_end,
                kv_head * cache_stride_head, dims, dim_ok, cache_stride_block, cache_stride_slot,
                PAGE,
            )  # fmt: skip
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            visible = key_pos[None, :] <= query_pos[:, None]  # [BLOCK_M, BLOCK_N]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_offsets + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def varlen_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton varlen paged attention for a flattened batch (prefill chunks and decodes).

    ``block_m`` query rows per program: 64 for long chunks on CUDA, else 16.
    """
    require_triton()
    check_paged_inputs(q, k_cache, v_cache, block_tables)
    num_seqs = seq_lens.shape[0]
    assert seq_lens.dtype == torch.int32 and query_start_loc.dtype == torch.int32
    assert query_start_loc.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    if block_m is None:
        block_m = 64 if q.is_cuda and max_query_len >= 128 else 16
    if num_seqs and max_query_len:
        grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_q_heads)
        _varlen_attention_kernel[grid](
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), num_q_heads // k_cache.shape[2], head_dim,
            BLOCK_M=block_m,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            PAGE=k_cache.shape[1],
            BLOCK_N=block_n or default_block_n(q.device),
            DOT_PRECISION=dot_precision(q.dtype),
        )  # fmt: skip
    return out
