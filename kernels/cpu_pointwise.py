"""A decoder layer's row-wise ops on the CPU through shoal's C kernels
(``kernels/cpu/layer_pointwise.c``): RMSNorm (+ residual), rotary, silu-and-mul and the KV write,
each one call instead of eager PyTorch's handful of small ops.

Each ``*_cpu`` function answers like its torch reference in ``kernels/`` (same shapes, new
tensors, the inputs untouched except the caches) or returns None where the C path does not
serve the inputs (not the CPU, not fp32/bf16, mixed dtypes, a layout it does not take, or no
compiler): the caller then runs the reference. ``SHOAL_KERNELS=torch`` turns the C path off.
"""

from __future__ import annotations

import ctypes

import torch

from shoal.kernels._backend import use_cpu_kernels
from shoal.kernels.cpu_build import load_kernel_library

LIBRARY = "layer_pointwise"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

_P, _I, _F, _B = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = (  # entry point, result, arguments
    ("rms_norm", None, (_P,) * 5 + (_I,) * 3 + (_F, _B)),
    ("rotary", _I, (_P,) * 6 + (_I,) * 9 + (_B, _B)),
    ("silu_and_mul", None, (_P,) * 2 + (_I,) * 3 + (_B,)),
    ("write_kv", _I, (_P,) * 5 + (_I,) * 5 + (_B,)),
)


def build_cpu_pointwise_kernels() -> bool:
    """The kernels built (or loaded) now; False where they cannot be or C kernels are off."""
    return use_cpu_kernels() and load_kernel_library(LIBRARY, _SIGNATURES) is not None


def _served(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library, where it serves these tensors: CPU, one kernel dtype, C kernels allowed.
    (Called for every op of a step: plain loops and ``is_cpu``, the cheapest checks here.)"""
    if not use_cpu_kernels():
        return None
    dtype = tensors[0].dtype
    if dtype not in KERNEL_DTYPES:
        return None
    for t in tensors:
        if not t.is_cpu or t.dtype != dtype:
            return None
    return load_kernel_library(LIBRARY, _SIGNATURES)


def _row_stride(x: torch.Tensor) -> int | None:
    """Elements between rows of ``x`` read as [rows, last dim], or None if it cannot be."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x.stride(0)
    return x.shape[-1] if x.is_contiguous() else None


def _new_rows(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of ``x``'s shape and dtype (``empty_like`` of a contiguous one
    is the cheaper call)."""
    if x.is_contiguous():
        return torch.empty_like(x)
    return torch.empty(x.shape, dtype=x.dtype)


def _is_bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def rms_norm_cpu(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """``rms_norm_torch``'s answer, or None where the C path does not serve these inputs."""
    parts = (x, weight) if residual is None else (x, weight, residual)
    lib, stride = _served(*parts), _row_stride(x)
    if lib is None or stride is None or not weight.is_contiguous():
        return None
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        return None
    hidden = x.shape[-1]
    out = _new_rows(x)
    summed = None if residual is None else _new_rows(x)
    lib.rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        None if summed is None else summed.data_ptr(),
        x.numel() // hidden if hidden else 0,
        hidden,
        stride,
        eps,
        _is_bf16(x),
    )
    return out if summed is None else (out, summed)


def _token_stride(t: torch.Tensor) -> int | None:
    """Elements between tokens of a [tokens, heads, head_dim] view whose heads are packed."""
    head_dim = t.shape[2]
    packed = t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == head_dim)
    return t.stride(0) if packed else None


def apply_rotary_cpu(
    q: torch.Tensor,  # [T, num_q_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim] fp32
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``apply_rotary_torch``'s answer, or None where the C path does not serve these inputs."""
    lib = _served(q, k)
    q_stride, k_stride = _token_stride(q), _token_stride(k)
    cache_ok = cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1
    if lib is None or q_stride is None or k_stride is None or not cache_ok:
        return None
    positions = positions.to(torch.int64).contiguous()
    q_out, k_out = _new_rows(q), _new_rows(k)
    outside = lib.rotary(
        q.data_ptr(),
        k.data_ptr(),
        q_out.data_ptr(),
        k_out.data_ptr(),
        positions.data_ptr(),
        cos_sin_cache.data_ptr(),
        q.shape[0],
        q.shape[1],
        k.shape[1],
        q.shape[2],
        cos_sin_cache.shape[1] // 2,
        q_stride,
        k_stride,
        cos_sin_cache.stride(0),
        cos_sin_cache.shape[0],
        int(is_neox),
        _is_bf16(q),
    )
    if outside:
        raise IndexError(f"{outside} rotary positions outside the cache of {len(cos_sin_cache)}")
    return q_out, k_out


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor | None:  # [T, 2 * inter] -> [T, inter]
    """``silu_and_mul_torch``'s answer, or None where the C path does not serve ``x``."""
    lib, stride = _served(x), _row_stride(x)
    if lib is None or stride is None:
        return None
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    lib.silu_and_mul(x.data_ptr(), out.data_ptr(), rows, inter, stride, _is_bf16(x))
    return out


def write_kv_cpu(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int; < 0 skips
) -> bool:
    """``write_kv_torch``'s writes; False (nothing written) where the C path does not serve."""
    lib = _served(key, value, k_cache, v_cache)
    key_stride, value_stride = _token_stride(key), _token_stride(value)
    caches_ok = k_cache.is_contiguous() and v_cache.is_contiguous()
    if lib is None or key_stride is None or value_stride is None or not caches_ok:
        return False
    slots = slot_mapping.to(torch.int64).contiguous()
    row_elems = key.shape[1] * key.shape[2]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    past_end = lib.write_kv(
        key.data_ptr(),
        value.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        key.shape[0],
        row_elems,
        key_stride,
        value_stride,
        num_slots,
        _is_bf16(key),
    )
    if past_end:
        raise IndexError(f"{past_end} KV slots past the cache's {num_slots}")
    return True
