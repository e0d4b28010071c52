"""Decode attention on the CPU through shoal's C kernel (``kernels/cpu/paged_decode_attention.c``):
every decode query of a step in one call, reading each context's keys and values once for all
the query heads that share a kv head, straight from the cache pages (no gather, no sparse
pattern). fp32 and bf16.

Planned once per step (``plan_cpu_decode``: the decodes' rows, block tables and lengths, and how
many pieces each context is split into so both threads have work when few sequences decode;
``plan_cpu_decodes_in_order`` where every sequence decodes, from the batch's own table), then
run per layer (``cpu_decode_attention``). Where the kernel cannot be built
(``cpu_build``), ``cpu_decode_available`` is False and the torch paths run.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from dataclasses import dataclass

import torch

from shoal.kernels._backend import use_cpu_kernels
from shoal.kernels.cpu_build import load_kernel_library

LIBRARY = "paged_decode_attention"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM, MAX_GROUP = 256, 32  # the C kernel's fixed buffers
MIN_SPLIT_KEYS = 128  # a context piece is never shorter (its merge costs more than it saves)
TILE_KEYS = 16  # keys the kernel scores together: pieces are whole tiles (the matrix path's pages)
ITEMS_PER_THREAD = 4  # (sequence, kv head, piece) items per thread, for balance


@dataclass(frozen=True)
class CpuDecodePlan:
    """One step's decodes, laid out for the C kernel; the same for every layer."""

    token_rows: torch.Tensor  # [n] int64 the query token of each decode in the flat batch
    block_tables: torch.Tensor  # [n, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [n] int32, contiguous
    splits: int  # pieces per context
    split_keys: int  # keys per piece
    kv_per_item: int  # kv heads per work item: 1, or all of them
    # token_rows is 0, 1, ..., n - 1: the queries are the batch's first n tokens, in order, so
    # they are read (and their outputs are) a slice of the batch's, with no gather or scatter
    in_order: bool = False


_SIGNATURES = (
    (
        "paged_decode_attention",
        ctypes.c_int,
        (ctypes.c_void_p,) * 7 + (ctypes.c_int64,) * 9 + (ctypes.c_float, ctypes.c_int),
    ),
    ("paged_decode_matrix_ready", ctypes.c_int, ()),
    ("paged_decode_matrix_calls", ctypes.c_int64, ()),
    ("paged_decode_set_matrix_units", None, (ctypes.c_int,)),
)


def _library() -> ctypes.CDLL | None:
    """The built library with its entry point typed (cached by ``load_kernel_library``)."""
    return load_kernel_library(LIBRARY, _SIGNATURES)


def build_cpu_decode_kernel() -> bool:
    """The kernel built (or loaded) now; False where it cannot be or C kernels are off."""
    return use_cpu_kernels() and _library() is not None


def decode_matrix_units_ready() -> bool:
    """Whether bf16 decodes can run on the CPU's matrix units (AMX) here: the kernel built for a
    CPU with them and the OS granting their state."""
    lib = _library()
    return lib is not None and bool(lib.paged_decode_matrix_ready())


def decode_matrix_calls() -> int:
    """Kernel calls whose bf16 decodes ran on the matrix units, in this process."""
    lib = _library()
    return 0 if lib is None else int(lib.paged_decode_matrix_calls())


def use_decode_matrix_units(allowed: bool) -> None:
    """On (the default) bf16 decodes take the matrix units where the CPU has them; off, the
    vector path (how the tests compare the two on one machine)."""
    lib = _library()
    if lib is not None:
        lib.paged_decode_set_matrix_units(int(allowed))


def cpu_decode_available(k_cache: torch.Tensor, num_q_heads: int) -> bool:
    """Whether the C kernel serves decodes over this cache (CPU, fp32/bf16, shapes it holds)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    return (
        k_cache.device.type == "cpu"
        and k_cache.dtype in KERNEL_DTYPES
        and head_dim <= MAX_HEAD_DIM
        and num_q_heads % num_kv_heads == 0
        and num_q_heads // num_kv_heads <= MAX_GROUP
        and _library() is not None
    )


def kv_heads_per_item(num_queries: int, num_q_heads: int, num_kv_heads: int) -> int:
    """A work item takes all of a sequence's kv heads (each page's rows read in one run) when
    there are sequences enough to keep every thread busy and their query heads fit the kernel's
    buffers; else one kv head (more, smaller items: one sequence still fills the threads)."""
    many = num_queries >= ITEMS_PER_THREAD * torch.get_num_threads()
    return num_kv_heads if many and num_q_heads <= MAX_GROUP else 1


def plan_cpu_decode(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    decodes: torch.Tensor,  # [n] int64 batch index of each query's sequence
    token_rows: torch.Tensor,  # [n] int64 the query's token in the flat batch
    key_lens: torch.Tensor,  # [n] the keys each query sees (its position + 1)
    num_q_heads: int,
    num_kv_heads: int,
) -> CpuDecodePlan:
    """The queries' tables and lengths, and the context split (one host read: the longest).
    A query is a decode, or one of a short run of queries at the end of a sequence (drafts
    being verified), each seeing the keys up to its own position."""
    lens = key_lens.to(torch.int32).contiguous()
    return _planned(
        token_rows, block_tables[decodes], lens, int(lens.max()), num_q_heads, num_kv_heads
    )


def plan_cpu_decodes_in_order(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    num_q_heads: int,
    num_kv_heads: int,
) -> CpuDecodePlan:
    """``plan_cpu_decode``'s plan for a step where every sequence decodes one token (query
    ``i`` is token ``i``: the common step), from the batch's own table and lengths: no gather
    of either (the step's whole attention plan ~27 us against ~80 the general way, here)."""
    lens = seq_lens.to(torch.int32).contiguous()
    token_rows = torch.arange(len(lens))
    plan = _planned(token_rows, block_tables, lens, int(lens.max()), num_q_heads, num_kv_heads)
    return dataclasses.replace(plan, in_order=True)


def _planned(
    token_rows: torch.Tensor,
    block_tables: torch.Tensor,  # [n, max_blocks] the queries' own rows
    lens: torch.Tensor,  # [n] int32, contiguous
    longest: int,
    num_q_heads: int,
    num_kv_heads: int,
) -> CpuDecodePlan:
    """The plan of these queries, with contexts split so every thread has work."""
    kv_per_item = kv_heads_per_item(len(lens), num_q_heads, num_kv_heads)
    items = len(lens) * (num_kv_heads // kv_per_item)
    wanted = math.ceil(ITEMS_PER_THREAD * torch.get_num_threads() / items)
    split_keys = max(MIN_SPLIT_KEYS, math.ceil(longest / max(1, wanted)))
    split_keys = math.ceil(split_keys / TILE_KEYS) * TILE_KEYS
    return CpuDecodePlan(
        token_rows=token_rows,
        block_tables=block_tables.to(torch.int32).contiguous(),
        seq_lens=lens,
        splits=max(1, math.ceil(longest / split_keys)),
        split_keys=split_keys,
        kv_per_item=kv_per_item,
    )


def cpu_decode_attention(
    q: torch.Tensor,  # [T, num_q_heads, head_dim], the whole step's queries
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: CpuDecodePlan,
    scale: float,
) -> torch.Tensor:  # [n, num_q_heads, head_dim], the decodes' outputs in plan order
    lib = _library()
    assert lib is not None, "plan_cpu_decode is only made where the kernel loaded"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the CPU decode kernel needs contiguous caches")
    if plan.in_order:
        queries = q[: len(plan.token_rows)]
    else:
        queries = q.index_select(0, plan.token_rows)
    if queries.dtype != k_cache.dtype:
        queries = queries.to(k_cache.dtype)
    queries = queries.contiguous()
    n, num_q_heads, head_dim = queries.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(queries)
    group = num_q_heads // num_kv_heads
    partial = torch.empty(
        n * num_kv_heads * plan.splits * group * (head_dim + 2), dtype=torch.float32
    )
    status = lib.paged_decode_attention(
        queries.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        plan.block_tables.data_ptr(),
        plan.seq_lens.data_ptr(),
        out.data_ptr(),
        partial.data_ptr(),
        n,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        plan.block_tables.shape[1],
        plan.splits,
        plan.split_keys,
        plan.kv_per_item,
        scale,
        int(k_cache.dtype == torch.bfloat16),
    )
    if status != 0:
        raise ValueError(f"CPU decode kernel refused shapes heads={num_q_heads}/{num_kv_heads}")
    return out if out.dtype == q.dtype else out.to(q.dtype)
