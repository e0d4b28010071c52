"""A decode step's dense decoder layers in one C call (``kernels/cpu/decoder_layers.c``): per
layer RMSNorm with the residual add, the q/k/v product, rotary + K/V write + decode attention
(``cpu_decode_step``'s kernel), the output product, RMSNorm, the gated MLP and the down product,
each by the kernel the layer-by-layer path calls (reached through pointers), so the same bits.

At decode batch sizes the Python around a layer's seven kernel calls and a dozen module calls
costs more than much of their arithmetic; here it is paid once a step. Served for layers whose
linear weights are packed strips (``strip_gemm``: floats, or in bf16 4- or 8-bit codes) without
biases, whose norms and caches share their dtype (fp32 or bf16), on a step
``plan_cpu_decode_step`` serves: ``layer_table`` says which (once per model, its pointers kept),
``run_decoder_layers`` runs a step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal.kernels import cpu_decode_attention, cpu_pointwise, strip_gemm
from shoal.kernels._backend import use_cpu_kernels
from shoal.kernels.cpu_build import load_kernel_library
from shoal.kernels.cpu_decode_step import CpuDecodeStep, partial_elements, raise_for_status
from shoal.kernels.strip_gemm import StripCodesWeight, StripWeight

StripProduct = StripWeight | StripCodesWeight

LIBRARY = "decoder_layers"
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
_GEMM_REFUSED = 16  # the C entry's answer where a product has no path
_KERNELS = (
    "gemm",
    "gated_gemm",
    "int4_gemm",
    "int8_gemm",
    "rms_norm",
    "silu_and_mul",
    "decode_step",
)
_SCRATCH = ("normed", "qkv", "q_rot", "attn", "gate_up", "act", "partial")
_WIDTHS = ("rows", "hidden", "qkv_width", "attn_width", "inter")
_PRODUCTS = ("qkv", "o_proj", "gate_up", "down")
_LAYER_PARTS = ("input_norm", "post_norm", *_PRODUCTS)


class _LayerSteps(ctypes.Structure):
    """The C side's ``LayerSteps``, field for field."""

    _fields_ = [
        *((name, _PTR) for name in _KERNELS),
        ("decode_fields", _PTR),
        *((name, _PTR) for name in _SCRATCH),
        *((name, _I64) for name in _WIDTHS),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("is_bf16", ctypes.c_int32),
    ]


class _Product(ctypes.Structure):
    """The C side's ``Product``: packed floats (bits 0) or codes with their scales."""

    _fields_ = [
        ("weights", _PTR),
        ("scales", _PTR),
        ("group", _I64),
        ("bits", ctypes.c_int32),
        ("round_x", ctypes.c_int32),
    ]


class _LayerWeights(ctypes.Structure):
    """The C side's ``LayerWeights``."""

    _fields_ = [
        ("input_norm", _PTR),
        ("post_norm", _PTR),
        *((name, _Product) for name in _PRODUCTS),
        ("k_cache", _PTR),
        ("v_cache", _PTR),
    ]


_SIGNATURES = (
    (
        "decoder_layers",
        ctypes.c_int,
        (
            ctypes.POINTER(_LayerSteps),
            ctypes.POINTER(_LayerWeights),
            _I64,
            _PTR,
            _PTR,
        ),
    ),
)

_calls = 0  # steps whose layers ran in the one call (for tests)


def build_decoder_layers_kernel() -> bool:
    """The library built (or loaded) now; False where it cannot be or C kernels are off."""
    return use_cpu_kernels() and _library() is not None


def decoder_layer_calls() -> int:
    """How many steps ran their layers through ``run_decoder_layers`` in this process."""
    return _calls


@dataclass(frozen=True)
class DecoderLayerParts:
    """What one dense layer's call reads: its norms' weights, its products (packed floats or
    code strips, no biases) and its caches."""

    input_norm: torch.Tensor  # [hidden]
    qkv: StripProduct  # [(q heads + 2 kv heads) * head_dim, hidden]
    o_proj: StripProduct  # [hidden, q heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: StripProduct  # [2 * inter, hidden]: gate rows, then up rows
    down: StripProduct  # [hidden, inter]
    k_cache: torch.Tensor  # [num_blocks, block_size, kv heads, head_dim]
    v_cache: torch.Tensor


@dataclass(frozen=True)
class LayerTable:
    """Every layer's pointers for the C call, the parts they point into (kept alive here), and
    the kernels' entry points."""

    layers: ctypes.Array
    parts: tuple[DecoderLayerParts, ...]
    kernels: tuple[int, ...]
    dtype: torch.dtype
    eps: float


def _entry(lib: ctypes.CDLL, name: str) -> int:
    address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    assert address is not None
    return address


def _kernels() -> tuple[int, ...] | None:
    """The entry points the C call runs, or None where a library is missing."""
    if not use_cpu_kernels():
        return None
    gemm = load_kernel_library(strip_gemm.LIBRARY)
    pointwise = load_kernel_library(cpu_pointwise.LIBRARY)
    decode = load_kernel_library(cpu_decode_attention.LIBRARY)
    if gemm is None or pointwise is None or decode is None or _library() is None:
        return None
    return (
        _entry(gemm, "strip_gemm"),
        _entry(gemm, "strip_gemm_gated"),
        _entry(gemm, "strip_gemm_int4"),
        _entry(gemm, "strip_gemm_int8"),
        _entry(pointwise, "rms_norm"),
        _entry(pointwise, "silu_and_mul"),
        _entry(decode, "paged_decode_step"),
    )


def _servable(parts: DecoderLayerParts, first: DecoderLayerParts, dtype: torch.dtype) -> bool:
    """Whether the C call serves this layer with the first layer's shapes."""
    weights = (parts.qkv, parts.o_proj, parts.gate_up, parts.down)
    tensors = (parts.input_norm, parts.post_norm, parts.k_cache, parts.v_cache)
    hidden = first.input_norm.shape[0]
    return (
        all(w.dtype == dtype for w in weights)  # (code strips multiply in bf16)
        and all(t.dtype == dtype and t.is_cpu and t.is_contiguous() for t in tensors)
        and all(getattr(parts, name).shape == getattr(first, name).shape for name in _LAYER_PARTS)
        and parts.k_cache.shape == parts.v_cache.shape == first.k_cache.shape
        and parts.qkv.in_features == parts.gate_up.in_features == hidden
        and parts.o_proj.out_features == parts.down.out_features == hidden
        and parts.gate_up.out_features == 2 * parts.down.in_features
    )


def layer_table(parts: Sequence[DecoderLayerParts], eps: float) -> LayerTable | None:
    """The layers' table for ``run_decoder_layers``, or None where the C call does not serve
    them (a library missing, C kernels off, a dtype other than fp32/bf16, mixed shapes)."""
    kernels = _kernels()
    if kernels is None or not parts:
        return None
    dtype = parts[0].input_norm.dtype
    if dtype not in strip_gemm.KERNEL_DTYPES or not all(
        _servable(p, parts[0], dtype) for p in parts
    ):
        return None
    layers = (_LayerWeights * len(parts))()
    for row, p in zip(layers, parts, strict=True):
        row.input_norm, row.post_norm = p.input_norm.data_ptr(), p.post_norm.data_ptr()
        for name in _PRODUCTS:
            setattr(row, name, _product(getattr(p, name)))
        row.k_cache, row.v_cache = p.k_cache.data_ptr(), p.v_cache.data_ptr()
    return LayerTable(layers, tuple(parts), kernels, dtype, eps)


def _product(weight: StripProduct) -> _Product:
    if isinstance(weight, StripWeight):
        return _Product(weight.packed.data_ptr(), None, 0, 0, 0)
    return _Product(
        weight.codes.data_ptr(),
        weight.scales.data_ptr(),
        weight.group_size,
        weight.bits,
        int(weight.rounds_x),
    )


def run_decoder_layers(
    x: torch.Tensor,  # [T, hidden]: the embedding's rows, overwritten
    table: LayerTable,
    step: CpuDecodeStep,  # planned on ``qkv``
    qkv: torch.Tensor,  # [T, qkv width]: scratch for the q/k/v rows, as planned
    scale: float,  # attention's
) -> tuple[torch.Tensor, torch.Tensor]:  # (the last MLP's output, the residual stream)
    """Every layer of a decode step, from the embedding's rows to what the final norm takes."""
    global _calls
    lib = _library()
    assert lib is not None, "a LayerTable is only made where the library loaded"
    first = table.parts[0]
    tokens, hidden = x.shape
    inter = first.down.in_features
    attn_width = first.o_proj.in_features
    dtype = table.dtype
    scratch = {
        "normed": torch.empty(tokens, hidden, dtype=dtype),
        "q_rot": torch.empty(tokens, attn_width, dtype=dtype),
        "attn": torch.empty(tokens, attn_width, dtype=dtype),
        "gate_up": torch.empty(tokens, 2 * inter, dtype=dtype),
        "act": torch.empty(tokens, inter, dtype=dtype),
        "partial": torch.empty(partial_elements(step), dtype=torch.float32),
    }
    residual = torch.empty_like(x)
    steps = _LayerSteps(
        *table.kernels,
        ctypes.addressof(step.fields),
        scratch["normed"].data_ptr(),
        qkv.data_ptr(),
        *(scratch[name].data_ptr() for name in _SCRATCH[2:]),
        tokens,
        hidden,
        qkv.shape[1],
        attn_width,
        inter,
        table.eps,
        scale,
        int(dtype == torch.bfloat16),
    )
    status = lib.decoder_layers(
        ctypes.byref(steps), table.layers, len(table.parts), x.data_ptr(), residual.data_ptr()
    )
    if status == _GEMM_REFUSED:
        raise RuntimeError(f"strip matmul has no path for {dtype} on this build")
    raise_for_status(status, step)
    _calls += 1
    return x, residual


def _library() -> ctypes.CDLL | None:
    return load_kernel_library(LIBRARY, _SIGNATURES)
