"""Prefill attention on the CPU's matrix units through shoal's C kernel
(``kernels/cpu/prefill_attention.c``): every run of bf16 queries of a step (prompt chunks) over
its sequence's paged cache in one call, causal, the tile products on AMX. Where the CPU, the OS
or the build has no matrix units, or the shape is not one the kernel takes,
``cpu_prefill_available`` is False and each sequence goes to torch's SDPA.

Planned once per step (``plan_cpu_prefill``: the runs' rows, block tables and lengths), run per
layer (``cpu_prefill_attention``).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from shoal.kernels._backend import use_cpu_kernels
from shoal.kernels.cpu_build import load_kernel_library

LIBRARY = "prefill_attention"
MAX_HEAD_DIM, MAX_GROUP, HEAD_DIM_STEP = 256, 16, 32  # the shapes the C kernel takes

_SIGNATURES = (
    (
        "prefill_attention",
        ctypes.c_int,
        (ctypes.c_void_p,) * 3
        + (ctypes.c_int64,)
        + (ctypes.c_void_p,) * 5
        + (ctypes.c_int64,) * 7
        + (ctypes.c_float,),
    ),
    ("prefill_attention_ready", ctypes.c_int, ()),
    ("prefill_attention_calls", ctypes.c_int64, ()),
)


@dataclass(frozen=True)
class CpuPrefillPlan:
    """One step's runs of queries for the C kernel; the same for every layer."""

    block_tables: torch.Tensor  # [m, max_blocks] int32, contiguous
    query_starts: torch.Tensor  # [m] int32: the run's first token in the flat batch
    query_lens: torch.Tensor  # [m] int32
    seq_lens: torch.Tensor  # [m] int32


def _library() -> ctypes.CDLL | None:
    return load_kernel_library(LIBRARY, _SIGNATURES)


def build_cpu_prefill_kernel() -> bool:
    """The kernel built (or loaded) now; False where it cannot be or C kernels are off. (Built
    on a CPU without AMX too: it then declines every call, and the prompts go to SDPA.)"""
    return use_cpu_kernels() and _library() is not None


@functools.cache
def _ready(lib: ctypes.CDLL) -> bool:
    return bool(lib.prefill_attention_ready())


def cpu_prefill_available(k_cache: torch.Tensor, num_q_heads: int) -> bool:
    """Whether the kernel serves prompt runs over this cache: bf16 on a CPU whose build and OS
    give it the matrix units, head size a multiple of 32 up to 256, GQA groups up to 16."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if not (
        k_cache.device.type == "cpu"
        and k_cache.dtype == torch.bfloat16
        and head_dim % HEAD_DIM_STEP == 0
        and head_dim <= MAX_HEAD_DIM
        and num_q_heads % num_kv_heads == 0
        and num_q_heads // num_kv_heads <= MAX_GROUP
        and use_cpu_kernels()
    ):
        return False
    lib = _library()
    return lib is not None and _ready(lib)


def plan_cpu_prefill(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    seqs: torch.Tensor,  # [m] int64: the sequences whose queries the kernel takes
) -> CpuPrefillPlan:
    starts = query_start_loc[seqs]
    return CpuPrefillPlan(
        block_tables=block_tables[seqs].to(torch.int32).contiguous(),
        query_starts=starts.to(torch.int32).contiguous(),
        query_lens=(query_start_loc[seqs + 1] - starts).to(torch.int32).contiguous(),
        seq_lens=seq_lens[seqs].to(torch.int32).contiguous(),
    )


def cpu_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim] bf16, rows may be strided
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: CpuPrefillPlan,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]: the planned runs' rows written
) -> bool:
    """The planned runs' attention into ``out``; False (nothing written to trust) where the
    kernel declines: queries or output not bf16 rows of heads side by side, caches not
    contiguous, buffers it could not allocate."""
    lib = _library()
    assert lib is not None, "plan_cpu_prefill only where cpu_prefill_available"
    rows = all(
        t.dtype == torch.bfloat16 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
        for t in (q, out)
    )
    if not (rows and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    tables = plan.block_tables
    code = lib.prefill_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        q.stride(0),
        tables.data_ptr(),
        plan.query_starts.data_ptr(),
        plan.query_lens.data_ptr(),
        plan.seq_lens.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        len(plan.seq_lens),
        q.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        tables.stride(0),
        scale,
    )
    return code == 0


def prefill_attention_calls() -> int:
    """How many calls of the kernel have run on the matrix units in this process."""
    lib = _library()
    return 0 if lib is None else int(lib.prefill_attention_calls())
