"""A decode-only step's attention on the CPU in one C call per layer
(``kernels/cpu/paged_decode_attention.c``'s ``paged_decode_step``): from the fused q/k/v
projection's rows, rotary on q and k, the rotated k and v written into their cache slots, and the
decode attention over the rotated queries. The same C code as ``apply_rotary_cpu``,
``write_kv_cpu`` and ``cpu_decode_attention`` called in turn, so the same bits; one call where
those were three, as their Python costs more than their arithmetic at small batches (at one
token on SmolLM2 the three wrappers took ~70 us a layer around ~30 us of C).

Planned once per step (``plan_cpu_decode_step``: None unless every token of the step is a
decode the C kernel serves in batch order, on the CPU, with a neox or interleaved rotary whose
cache is fp32), then run per layer (``cpu_decode_step``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from shoal.kernels.cpu_build import load_kernel_library
from shoal.kernels.cpu_decode_attention import KERNEL_DTYPES, LIBRARY, CpuDecodePlan

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_OUTSIDE_POSITIONS, _PAST_CACHE = 2, 3  # the C entry's refusals
_POINTERS = ("positions", "slots", "cos_sin", "block_tables", "seq_lens")
_COUNTS = (
    "n", "hq", "hkv", "d", "half", "cos_sin_stride", "num_positions", "num_slots", "qkv_stride",
    "block_size", "table_stride", "splits", "split_keys", "kv_per_item",
)  # fmt: skip


class _DecodeStep(ctypes.Structure):
    """The C side's ``DecodeStep``, field for field."""

    _fields_ = [
        *((name, _PTR) for name in _POINTERS),
        *((name, _I64) for name in _COUNTS),
        ("is_neox", ctypes.c_int32),
        ("is_bf16", ctypes.c_int32),
    ]


_SIGNATURES = (
    (
        "paged_decode_step",
        ctypes.c_int,
        (ctypes.POINTER(_DecodeStep),) + (_PTR,) * 6 + (ctypes.c_float,),
    ),
)

_calls = 0  # steps' layers run through the one call (for tests)


def fused_decode_calls() -> int:
    """How many layer calls went through ``cpu_decode_step`` in this process."""
    return _calls


@dataclass(frozen=True)
class CpuDecodeStep:
    """One step's fields for every layer's call, and the tensors they point into (kept alive
    here for as long as the step is)."""

    fields: _DecodeStep
    tensors: tuple[torch.Tensor, ...]
    plan: CpuDecodePlan
    num_q_heads: int
    head_dim: int


def plan_cpu_decode_step(
    qkv: torch.Tensor,  # [T, (q heads + 2 kv heads) * head_dim], the fused projection's rows
    decode: CpuDecodePlan | None,  # the step's decode plan (None: it has none)
    has_other_queries: bool,  # queries the decode plan does not take (prefill chunks)
    positions: torch.Tensor,  # [T] int
    slot_mapping: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim] fp32, cos then sin
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    num_q_heads: int,
    is_neox: bool,
) -> CpuDecodeStep | None:
    """The step's fields, or None where the one call does not serve it (the three calls do)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    tokens = qkv.shape[0]
    served = (
        decode is not None
        and decode.in_order
        and not has_other_queries
        and len(decode.token_rows) == tokens
        and qkv.device.type == "cpu"
        and qkv.dtype == k_cache.dtype
        and qkv.dtype in KERNEL_DTYPES
        and qkv.dim() == 2
        and qkv.stride(1) == 1
        and qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * head_dim
        and k_cache.is_contiguous()
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.stride(1) == 1
        and cos_sin_cache.shape[1] <= head_dim
        and _library() is not None
    )
    if not served:
        return None
    assert decode is not None
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    fields = _DecodeStep(
        positions.data_ptr(),
        slots.data_ptr(),
        cos_sin_cache.data_ptr(),
        decode.block_tables.data_ptr(),
        decode.seq_lens.data_ptr(),
        tokens,
        num_q_heads,
        num_kv_heads,
        head_dim,
        cos_sin_cache.shape[1] // 2,
        cos_sin_cache.stride(0),
        cos_sin_cache.shape[0],
        num_blocks * block_size,
        qkv.stride(0),
        block_size,
        decode.block_tables.shape[1],
        decode.splits,
        decode.split_keys,
        decode.kv_per_item,
        int(is_neox),
        int(qkv.dtype == torch.bfloat16),
    )
    kept = (positions, slots, cos_sin_cache, decode.block_tables, decode.seq_lens)
    return CpuDecodeStep(fields, kept, decode, num_q_heads, head_dim)


def partial_elements(step: CpuDecodeStep) -> int:
    """The fp32 scratch the decode kernel needs for the step's context splits."""
    fields = step.fields
    group = step.num_q_heads // fields.hkv
    return int(fields.n * fields.hkv * step.plan.splits * group * (step.head_dim + 2))


def raise_for_status(status: int, step: CpuDecodeStep) -> None:
    """The error for ``paged_decode_step``'s answer (none for 0)."""
    if status == _OUTSIDE_POSITIONS:
        raise IndexError("rotary positions outside the cache of the step's cos/sin rows")
    if status == _PAST_CACHE:
        raise IndexError(f"KV slots past the cache's {step.fields.num_slots}")
    if status != 0:
        raise ValueError(
            f"CPU decode kernel refused shapes heads={step.num_q_heads}/{step.fields.hkv}"
        )


def cpu_decode_step(
    qkv: torch.Tensor,  # [T, (q heads + 2 kv heads) * head_dim], as planned
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: CpuDecodeStep,
    scale: float,
) -> torch.Tensor:  # [T, num_q_heads * head_dim]
    """Rotary, the KV write and the decode attention of one layer, in one call."""
    global _calls
    lib = _library()
    assert lib is not None, "a CpuDecodeStep is only made where the kernel loaded"
    if not v_cache.is_contiguous():
        raise ValueError("the CPU decode kernel needs contiguous caches")
    tokens, heads, head_dim = qkv.shape[0], step.num_q_heads, step.head_dim
    rotated = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype)
    out = torch.empty(tokens, heads * head_dim, dtype=qkv.dtype)
    partial = torch.empty(partial_elements(step), dtype=torch.float32)
    status = lib.paged_decode_step(
        ctypes.byref(step.fields),
        qkv.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        rotated.data_ptr(),
        out.data_ptr(),
        partial.data_ptr(),
        scale,
    )
    raise_for_status(status, step)
    _calls += 1
    return out


def _library() -> ctypes.CDLL | None:
    return load_kernel_library(LIBRARY, _SIGNATURES)
