"""Weight-only quantized matmuls on the CPU: a linear weight kept as 4- or 8-bit integer codes
with a scale per group of input values (``QuantizedWeight``), packed once, multiplied by torch's
int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu`` on ``_convert_weight_to_int4pack_for_cpu``'s
packing) with bf16 activations.

* int4 (``pack_int4``): codes 0..15 with a scale and a minimum per group (``w = scale * q +
  min``: GGUF Q4_1's form; Q4_0's is ``min = -8 * scale``). The kernel's own dequantization
  (torch's ``int4mm_kernel.cpp``; checked by a round trip in tests/kernels/test_quant_gemm.py)
  is ``w = scale * (q - 8) + zero``, one FMA in fp32, so ``zero = min + 8 * scale``.
* int8 (``pack_int8``): codes -127..127 with a scale per group (GGUF Q8_0's form,
  ``w = scale * q``), as two 4-bit halves of ``u = q + 128 = 16 * hi + lo`` side by side
  along the input: ``w = 16 scale * (hi - 8) + scale * (lo - 8) + 8 scale``, the activations
  fed twice (``[x, x]``). The codes and group scales stay exact: no requantization to the one
  scale per output channel that ``_weight_int8pack_mm`` takes.

Why this kernel, measured at SmolLM2-135M's shapes (30 layers of 576→960, 576→576, 576→3072,
1536→576 and the 576→49152 head, every weight distinct so each is read from memory; 2 threads,
a 2-core AMD EPYC with AVX-512 and AVX512-BF16, nothing else running; ms for all of them, one
step; the first three rows and the int4 row from one run, the others from earlier runs):

    tokens (M)                          1      4      8     16     32     64
    oneDNN packed, fp32 (shoal's)    39.5   34.7   39.9   41.9   66.2  126.2
    oneDNN packed, bf16              21.7   21.5   25.8   28.4   39.3   61.1
    int4 kernel, bf16, group 32       7.4    9.9   18.5   35.6   64.1  132.1
    int4 kernel, fp32 / fp16        133.8 / 198.4
    int8 as two int4 halves, bf16    15.3          37.7
    _weight_int8pack_mm, bf16        15.1          38.6
    _weight_int8pack_mm, fp32 / fp16 78.1 / 109.1  847.0 (fp32)
    fbgemm dynamic W8A8, fp32        12.1          14.2                  73.8

The int4 kernel in bf16 reads 0.625 byte per weight (int8 as two halves: 1.25) and is the
fastest up to about 8 tokens (5.4x fp32 oneDNN at one token); torch vectorizes it (and
``_weight_int8pack_mm``) for bf16 only. For int8 the two halves run as fast as
``_weight_int8pack_mm`` and keep Q8_0's group scales. fbgemm's W8A8 quantizes the activations
too (not weight-only). Past about 16 tokens the int4 kernel (it dequantizes the weight again for
every 4 rows) falls behind oneDNN: prefill and large batches run slower than on float weights.

Activations are cast to bf16 for the kernel and the output back to their dtype; scales and
zeros are stored in bf16 (rounded to 8 bits of mantissa). On SmolLM2 the scales' rounding
changed no greedy answer; the activations' and outputs' rounding does move answers at near-ties,
as a bf16 model's does (docs/models.md). ``SHOAL_QUANT_DTYPE=float32`` (read when a weight is
packed) runs the kernel in fp32 instead: GGUF's dequantization bit for bit, 18x slower; for
checking. Output features are padded to the kernel's blocks of 16 with zero rows and the
product cut back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ENV_VAR = "SHOAL_QUANT_DTYPE"
_COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
GROUP_SIZES = (32, 64, 128, 256)
ROW_BLOCK = 16  # output features come in blocks of this many
ZERO_CODE = 8  # the kernel reads code q as (q - 8)
# The function itself: torch.ops.aten's packet resolves its overload on every call (~2 us here).
_INT4_MM = torch._weight_int4pack_mm_for_cpu
INT8_OFFSET = 128  # int8 code q is stored as the two nibbles of q + 128


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight ``[out, in]`` as integer codes packed for torch's int4 CPU kernel."""

    bits: int  # 4, or 8 (two 4-bit halves)
    packed: torch.Tensor  # uint8 [padded out, kernel in / 2], torch's int4 packing
    scales: torch.Tensor  # [kernel in / group, padded out, 2]: (scale, zero) per group
    group_size: int  # input values sharing a scale
    out_features: int
    in_features: int  # the kernel's is twice this for 8 bits

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the kernel multiplies in (the scales', the activations' cast)."""
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: codes and scales."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))


def compute_dtype() -> torch.dtype:
    """The dtype weights packed now multiply in (``SHOAL_QUANT_DTYPE``, bf16 by default)."""
    choice = os.environ.get(ENV_VAR, "bfloat16").strip().lower() or "bfloat16"
    if choice not in _COMPUTE_DTYPES:
        raise ValueError(f"{ENV_VAR}={choice!r}: expected one of {', '.join(_COMPUTE_DTYPES)}")
    return _COMPUTE_DTYPES[choice]


def pack_int4(
    codes: torch.Tensor,  # [out, in] uint8, 0..15
    scales: torch.Tensor,  # [out, in / group_size]
    mins: torch.Tensor,  # [out, in / group_size]
    group_size: int,
) -> QuantizedWeight:
    """``w = scale * code + min`` per group of ``group_size`` input values."""
    _check_groups(codes, scales, group_size)
    zeros = mins.float() + ZERO_CODE * scales.float()
    return _packed(4, codes, scales.float(), zeros, group_size, codes.shape[1])


def pack_int8(
    codes: torch.Tensor,  # [out, in] int8, -127..127
    scales: torch.Tensor,  # [out, in / group_size]
    group_size: int,
) -> QuantizedWeight:
    """``w = scale * code`` per group of ``group_size`` input values, as two 4-bit halves."""
    _check_groups(codes, scales, group_size)
    if codes.dtype != torch.int8:
        raise ValueError(f"int8 weight: codes are {codes.dtype}, expected torch.int8")
    unsigned = codes.to(torch.int32) + INT8_OFFSET  # 1..255
    halves = torch.cat([unsigned >> 4, unsigned & 0x0F], dim=1)  # [out, 2 in]: hi, then lo
    scales = scales.float()
    half_scales = torch.cat([16 * scales, scales], dim=1)
    half_zeros = torch.cat([torch.zeros_like(scales), ZERO_CODE * scales], dim=1)
    return _packed(8, halves, half_scales, half_zeros, group_size, codes.shape[1])


def linear(
    x: torch.Tensor,  # [..., in]
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [..., out], x's dtype
    """``x @ w.T + bias`` with ``w`` the weight's codes dequantized inside the kernel."""
    rows = x if x.dim() == 2 else x.reshape(-1, weight.in_features)
    if rows.dtype != weight.dtype:
        rows = rows.to(weight.dtype)
    if weight.bits == 8:
        rows = torch.cat([rows, rows], dim=1)
    out = _INT4_MM(rows.contiguous(), weight.packed, weight.group_size, weight.scales)
    if out.shape[-1] != weight.out_features:  # padded rows cut back
        out = out[:, : weight.out_features].contiguous()
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if x.dim() != 2:
        out = out.reshape(*x.shape[:-1], weight.out_features)
    return out if bias is None else out + bias


def _packed(
    bits: int,
    codes: torch.Tensor,  # [out, kernel in], 0..15
    scales: torch.Tensor,  # [out, kernel in / group] fp32
    zeros: torch.Tensor,  # [out, kernel in / group] fp32
    group_size: int,
    in_features: int,
) -> QuantizedWeight:
    out_features = codes.shape[0]
    pad = -out_features % ROW_BLOCK
    scales_and_zeros = _pad_rows(torch.stack([scales, zeros], dim=-1), pad).transpose(0, 1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        _pad_rows(codes.to(torch.int32), pad).contiguous(), 1
    )
    return QuantizedWeight(
        bits=bits,
        packed=packed,
        scales=scales_and_zeros.to(compute_dtype()).contiguous(),
        group_size=group_size,
        out_features=out_features,
        in_features=in_features,
    )


def _check_groups(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
    out_features, in_features = codes.shape
    if group_size not in GROUP_SIZES or in_features % group_size:
        raise ValueError(
            f"quantized weight with {in_features} input features in groups of {group_size}: "
            f"the kernel takes groups of {', '.join(map(str, GROUP_SIZES))} that divide them"
        )
    if tuple(scales.shape) != (out_features, in_features // group_size):
        raise ValueError(
            f"quantized weight [{out_features}, {in_features}]: scales {tuple(scales.shape)}, "
            f"expected one per group of {group_size}"
        )


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
