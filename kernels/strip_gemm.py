"""Linear layers on the CPU through shoal's strip matmul (``kernels/cpu/strip_gemm.c``): a
float weight packed once into strips of 16 output features (``StripWeight``), multiplied by a
kernel that streams each strip in one run.

Why, measured on SmolLM2-135M's shapes (30 layers of 576->960, 576->576, 576->3072, 1536->576,
every weight distinct so each is read from memory; 2 threads, a 2-core AMD EPYC with AVX-512 and
AVX512-BF16; ms for all 120 of them, oneDNN packed / strips, interleaved in one process):

    tokens (M)        1            8            16           64           256          1024
    bf16       10.9 / 5.1   12.2 / 8.3   15.3 / 12.5  42.8 / 36.8  136.6 / 139.1  523.8 / 508.7
    fp32       19.4 / 12.5  20.3 / 14.3  26.8 / 21.6  72.2 / 66.6  254.1 / 254.3  1035.8 / 1022.0

At one token oneDNN reads the weights at ~19 GB/s and the strips at ~40 (bf16); from a few
hundred tokens both are bound by the arithmetic and even. One copy of each weight either way.

The kernel has a path for fp32 where the compiler targets AVX-512 and for bf16 where it targets
AVX512-BF16 (``strip_gemm_available``); elsewhere ``kernels.gemm`` keeps oneDNN's. Where the CPU
also has matrix units (AMX-BF16), bf16 products run on them from the same strips (their layout
is AMX's for a tile product's weight operand; ``use_matrix_units``). On a 2-core Xeon with AMX,
SmolLM2's 30 layers of linears (the same bytes, unfused: 210 weights) at 1 / 8 / 16 tokens took
9.8 / 10.1 / 10.5 ms on the matrix units against 10.2 / 19.7 / 26.7 on the vector path; the
whole SmolLM2 in bf16, 64 prompts through ``LLM``, 309 tokens/s on the vector path, 777 on the
matrix units, 757-773 with oneDNN's AMX products (one request: 51-53 tokens/s, 45 with oneDNN).

Integer codes (``StripCodesWeight``: GGUF Q4_0/Q4_1's ``scale * code + min`` and Q8_0's
``scale * code`` per group, fp16 scales as the file stores them) run in the same strips on
AVX512-BF16, in bf16, in place of torch's int4 kernel (``quant_gemm``; 8 bits there as two 4-bit
halves); ``workers/layers/weight_quantizing.py`` sends 8-bit codes here, 4-bit ones when asked.
4 bits, the same shapes and machine, ms (torch's int4 / strips):

    tokens (M)    1            4            16            64            256
    int4       5.2 / 5.4    7.3 / 6.5    22.3 / 15.9   84.1 / 52.2   331.0 / 201.1

Even at one token (decoding the codes costs about the instructions that the bytes saved would
have cost in time); 1.4-1.6x from 16 tokens, though still behind bf16 strips there (at 256
tokens 201 ms against 133: the decode is paid per weight and row tile). 8 bits, SmolLM2's
49152 x 576 head, ms (torch's two halves / 8-bit strips / the head in bf16 strips): one token
1.68 / 1.00 / 1.53, 16 tokens 11.66 / 5.80 / 3.30, 64 tokens 47.11 / 23.82 / 10.25; the codes
widen to fp32 and meet x in fp32 products (half the products an instruction of bf16's).

With ``round_x`` (``pack_int4_strips``, AVX512-VNNI: ``code_strips_round_x``) x is rounded to 8
bits a group and dotted with the codes in integers, 64 products an instruction (llama.cpp's
numerics for Q4 weights; docs/cpu.md has its speed and its error).

Where the matrix units are on, a product of codes at 8 rows or more (and not ``round_x``)
decodes its weight once into bf16 strips, ``w = scale * code (+ min)`` rounded to bf16 as a
bf16 checkpoint holds it, in scratch of the calling thread, and runs there
(``decoded_code_products`` counts them), a run of strips at a time: the codes' own dots issue
about half an instruction a cycle. SmolLM2's 120 4-bit products on a 2-core Xeon with AMX, ms
(codes / decoded): 8 tokens 14.0 / 8.6, 32: 50.9 / 11.1, 64: 95.4 / 15.4, 512: 733 / 61; its
8-bit 49152 x 576 head at 32 tokens 10.4 / 2.8. Below 8 tokens the codes' path stays.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import torch

from shoal.kernels._backend import use_cpu_kernels
from shoal.kernels.cpu_build import load_kernel_library

LIBRARY = "strip_gemm"
STRIP = 16  # output features per strip (the kernel's)
AMX_K_STEP = 32  # inputs a tile product takes (the kernel's)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = (
    ("strip_gemm", ctypes.c_int, (_P,) * 4 + (_I,) * 4 + (ctypes.c_int,)),
    ("strip_gemm_int4", ctypes.c_int, (_P,) * 5 + (_I,) * 5 + (ctypes.c_int,)),
    ("strip_gemm_int4_rounds_x", ctypes.c_int, ()),
    ("strip_gemm_int8", ctypes.c_int, (_P,) * 5 + (_I,) * 5),
    ("strip_gemm_wide", ctypes.c_int, (ctypes.c_int,)),
    ("strip_gemm_set_amx", ctypes.c_int, (ctypes.c_int,)),
    ("strip_gemm_amx_products", ctypes.c_int64, ()),
    ("strip_gemm_decoded_products", ctypes.c_int64, ()),
    ("strip_gemm_gated", ctypes.c_int, (_P,) * 4 + (_I,) * 4),
)
_matrix_units: weakref.WeakKeyDictionary[ctypes.CDLL, bool] = weakref.WeakKeyDictionary()
CODE_GROUP_MULTIPLE = 4  # a group of inputs sharing a scale is whole quads of 4-bit codes


@dataclass(frozen=True)
class StripWeight:
    """A linear weight ``[out, in]`` packed in strips of 16 output features (zero rows pad the
    last): fp32 ``[strips, in, 16]``, bf16 ``[strips, in / 2, 16, 2]``."""

    packed: torch.Tensor
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: the strips (padding included)."""
        return self.packed.numel() * self.packed.element_size()

    def to_dense(self) -> torch.Tensor:  # [out, in]
        strips = self.packed.shape[0]
        if self.dtype == torch.bfloat16:
            rows = self.packed.permute(0, 2, 1, 3).reshape(strips * STRIP, self.in_features)
        else:
            rows = self.packed.permute(0, 2, 1).reshape(strips * STRIP, self.in_features)
        return rows[: self.out_features].contiguous()


def _library() -> ctypes.CDLL | None:
    return load_kernel_library(LIBRARY, _SIGNATURES)


def strip_gemm_available(dtype: torch.dtype) -> bool:
    """Whether this CPU's build of the kernel has a vector path for ``dtype`` (and C kernels
    are allowed)."""
    if dtype not in KERNEL_DTYPES or not use_cpu_kernels():
        return False
    lib = _library()
    return lib is not None and bool(lib.strip_gemm_wide(int(dtype == torch.bfloat16)))


def use_matrix_units(on: bool) -> bool:
    """Send bf16 products to the CPU's matrix units (AMX: the default where this build has the
    path and the OS grants the tile state) or keep them on the vector path; returns whether they
    go there now."""
    lib = _library()
    if lib is None:
        return False
    _matrix_units[lib] = state = bool(lib.strip_gemm_set_amx(int(on)))
    return state


def _on_matrix_units(lib: ctypes.CDLL) -> bool:
    """Whether ``lib``'s bf16 products go to the matrix units (asked of it once, as its first
    product would)."""
    state = _matrix_units.get(lib)
    if state is None:
        _matrix_units[lib] = state = bool(lib.strip_gemm_set_amx(1))
    return state


def matrix_unit_products() -> int:
    """How many strip products have run on the matrix units in this process."""
    lib = _library()
    return 0 if lib is None else int(lib.strip_gemm_amx_products())


def decoded_code_products() -> int:
    """How many products of codes have run on the matrix units through decoded bf16 strips in
    this process."""
    lib = _library()
    return 0 if lib is None else int(lib.strip_gemm_decoded_products())


def strip_packable(weight: torch.Tensor) -> bool:
    """Whether ``pack_strips`` takes this weight's shape and dtype (bf16's inputs come in
    pairs: an even input size)."""
    return (
        weight.dim() == 2
        and weight.dtype in KERNEL_DTYPES
        and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0)
    )


def pack_strips(weight: torch.Tensor) -> StripWeight:  # [out, in]
    """``weight`` laid out for the kernel (check ``strip_packable`` first)."""
    out_features, in_features = weight.shape
    strips = -(-out_features // STRIP)
    rows = torch.zeros(strips * STRIP, in_features, dtype=weight.dtype)
    rows[:out_features] = weight.detach()
    if weight.dtype == torch.bfloat16:
        packed = rows.view(strips, STRIP, in_features // 2, 2).permute(0, 2, 1, 3)
    else:
        packed = rows.view(strips, STRIP, in_features).permute(0, 2, 1)
    return StripWeight(packed.contiguous(), out_features, in_features)


def strip_linear(
    x: torch.Tensor,  # [..., in], the weight's dtype
    weight: StripWeight,
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [..., out]
    """``x @ weight.T + bias``."""
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(f"strip matmul of {weight.dtype} weights got {x.dtype} inputs")
    rows = _as_rows(x, weight.in_features)
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(rows.shape[0], weight.out_features, dtype=x.dtype)
    lib = _library()
    assert lib is not None, "a StripWeight is only made where the kernel loaded"
    status = lib.strip_gemm(
        weight.packed.data_ptr(),
        rows.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        weight.out_features,
        weight.in_features,
        rows.stride(0),
        int(x.dtype == torch.bfloat16),
    )
    if status != 0:
        raise RuntimeError(f"strip matmul has no path for {x.dtype} on this build")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.out_features)


def strip_gated_linear(
    x: torch.Tensor,  # [..., in] bf16
    weight: StripWeight,  # [2 * inter, in]: gate rows, then up rows
    bias: torch.Tensor | None = None,  # [2 * inter]
) -> torch.Tensor | None:  # [..., inter]
    """``silu(gate) * up`` of ``x @ weight.T + bias`` in one call, bit for bit what
    ``strip_linear`` then the C ``silu_and_mul`` answer, without the products between them; or
    None where the kernel has no such path (not bf16, the matrix units off, a shape that is not
    whole tiles): the caller then makes the two calls."""
    lib = _library()
    assert lib is not None, "a StripWeight is only made where the kernel loaded"
    inter = weight.out_features // 2
    if not (
        x.dtype == weight.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
        and weight.out_features == 2 * inter
        and inter % STRIP == 0
        and weight.in_features % AMX_K_STEP == 0
        and _on_matrix_units(lib)
    ):
        return None  # decided before any work: elsewhere every gated MLP layer comes here
    rows = _as_rows(x, weight.in_features)
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype)
    status = lib.strip_gemm_gated(
        weight.packed.data_ptr(),
        rows.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        inter,
        weight.in_features,
        rows.stride(0),
    )
    if status != 0:
        return None
    return out if x.dim() == 2 else out.view(*x.shape[:-1], inter)


@dataclass(frozen=True)
class StripCodesWeight:
    """A linear weight ``[out, in]`` as integer codes in strips of 16 output features, with a
    scale (and for 4 bits a minimum) per group of inputs: 4 bits (``w = scale * code + min``)
    as codes ``[strips, in / 4, 32]`` uint8, two a byte, and scales ``[strips, groups, 2, 16]``
    fp16 (scale, min); 8 bits (``w = scale * code``) as codes ``[strips, in, 16]`` int8 and
    scales ``[strips, groups, 1, 16]`` fp16. Multiplies in bf16."""

    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    group_size: int
    out_features: int
    in_features: int
    rounds_x: bool = False  # 4 bits: x rounded to 8 bits a group, dotted in integers

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the kernel multiplies in (activations are cast to it)."""
        return torch.bfloat16

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: codes and scales."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales))


def code_strips_available(group_size: int, in_features: int) -> bool:
    """Whether codes of this grouping can go in strips here (AVX512-BF16)."""
    fits = group_size % CODE_GROUP_MULTIPLE == 0 and in_features % group_size == 0
    return fits and strip_gemm_available(torch.bfloat16)


def _strip_scales(per_group: list[torch.Tensor], out_features: int) -> torch.Tensor:
    """``[out, groups]`` tensors (scale, then min) as ``[strips, groups, len, 16]`` fp16."""
    strips = -(-out_features // STRIP)
    groups = per_group[0].shape[1]
    stacked = torch.zeros(strips * STRIP, groups, len(per_group), dtype=torch.float16)
    for i, values in enumerate(per_group):
        stacked[:out_features, :, i] = values
    return stacked.view(strips, STRIP, groups, len(per_group)).permute(0, 2, 3, 1).contiguous()


def _padded_rows(codes: torch.Tensor) -> torch.Tensor:
    out_features = codes.shape[0]
    padded = codes.new_zeros(-(-out_features // STRIP) * STRIP, codes.shape[1])
    padded[:out_features] = codes
    return padded


def code_strips_round_x() -> bool:
    """Whether 4-bit code strips can meet x rounded to 8 bits here (AVX512-VNNI)."""
    lib = _library()
    return lib is not None and bool(lib.strip_gemm_int4_rounds_x())


def pack_int4_strips(
    codes: torch.Tensor,  # [out, in] uint8, 0..15
    scales: torch.Tensor,  # [out, in / group_size]
    mins: torch.Tensor,  # [out, in / group_size]
    group_size: int,
    round_x: bool = False,
) -> StripCodesWeight:
    """``w = scale * code + min`` in the kernel's layout: byte ``b`` of a quad of inputs
    ``4j..4j+3`` holds output ``b // 2``'s code for input ``4j + b % 2`` in its low nibble and
    for ``4j + 2 + b % 2`` in its high one; scales and minimums in fp16 (GGUF's own).
    ``round_x``: products round x to 8 bits a group (``code_strips_round_x``)."""
    if round_x and not code_strips_round_x():
        raise ValueError("4-bit codes meet x rounded to 8 bits only where the CPU has AVX512-VNNI")
    out_features, in_features = codes.shape
    padded = _padded_rows(codes)
    strips = padded.shape[0] // STRIP
    quads = padded.view(strips, STRIP, in_features // 4, 2, 2)  # strip, out, quad, pair, input
    nibbles = quads[:, :, :, 0, :] | (quads[:, :, :, 1, :] << 4)  # [strips, 16, quads, 2]
    packed = nibbles.permute(0, 2, 1, 3).reshape(strips, in_features // 4, 2 * STRIP)
    return StripCodesWeight(
        4,
        packed.contiguous(),
        _strip_scales([scales, mins], out_features),
        group_size,
        out_features,
        in_features,
        round_x,
    )


def pack_int8_strips(
    codes: torch.Tensor,  # [out, in] int8
    scales: torch.Tensor,  # [out, in / group_size]
    group_size: int,
) -> StripCodesWeight:
    """``w = scale * code`` in strips: ``[strips, in, 16]`` codes, fp16 scales (GGUF's own)."""
    out_features, in_features = codes.shape
    padded = _padded_rows(codes)
    packed = padded.view(-1, STRIP, in_features).permute(0, 2, 1).contiguous()
    return StripCodesWeight(
        8, packed, _strip_scales([scales], out_features), group_size, out_features, in_features
    )


def strip_codes_linear(
    x: torch.Tensor,  # [..., in]
    weight: StripCodesWeight,
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [..., out], x's dtype
    """``x @ w.T + bias``, ``x`` multiplied in bf16."""
    rows = _as_rows(x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16), weight.in_features)
    bias16 = None if bias is None else bias.to(torch.bfloat16).contiguous()
    out = torch.empty(rows.shape[0], weight.out_features, dtype=torch.bfloat16)
    lib = _library()
    assert lib is not None, "a StripCodesWeight is only made where the kernel loaded"
    args = (
        weight.codes.data_ptr(),
        weight.scales.data_ptr(),
        rows.data_ptr(),
        None if bias16 is None else bias16.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        weight.out_features,
        weight.in_features,
        weight.group_size,
        rows.stride(0),
    )
    if weight.bits == 4:
        status = lib.strip_gemm_int4(*args, weight.rounds_x)
    else:
        status = lib.strip_gemm_int8(*args)
    if status != 0:
        raise RuntimeError(f"{weight.bits}-bit strip matmul has no path for these codes here")
    if x.dtype != torch.bfloat16:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.out_features)


def _as_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """``x`` as ``[rows, in_features]`` with unit stride along a row (a 2-D input as it is:
    each torch call here costs about a microsecond, and a layer makes several a step)."""
    rows = x if x.dim() == 2 else x.reshape(-1, in_features)
    return rows if rows.stride(1) == 1 else rows.contiguous()
