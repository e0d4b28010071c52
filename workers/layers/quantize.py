"""Float weights turned into integer codes (``QuantizedTensor``) at load, for the weight-only
quantized matmuls (``kernels.quant_gemm``): ``--quantization int8`` (symmetric, a scale per
group of input values: GGUF Q8_0's scheme) and ``int4`` (a scale and a minimum per group: GGUF
Q4_1's scheme), both in groups of ``GROUP_SIZE``.
"""

from __future__ import annotations

import torch

from shoal.workers.layers.quantized_tensor import QuantizedTensor

INT8_MAX = 127
INT4_MAX = 15
# GGUF's block, and the kernel's smallest group; SmolLM2's 576-wide rows have no larger one.
GROUP_SIZE = 32


def quantize_int8(weight: torch.Tensor, source: str, group_size: int) -> QuantizedTensor:
    """``weight`` ``[rows, cols]`` as int8 codes in groups of ``group_size`` along ``cols``:
    ``scale = max|w| / 127``, ``code = round(w / scale)`` (an all-zero group keeps scale 0)."""
    groups, rows, cols = _groups(weight, group_size, "int8")
    scales = groups.abs().amax(dim=-1) / INT8_MAX
    codes = torch.where(scales[..., None] > 0, groups / _nonzero(scales)[..., None], 0)
    return QuantizedTensor(
        bits=8,
        codes=codes.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8).reshape(rows, cols),
        scales=scales,
        mins=None,
        group_size=group_size,
        source=source,
    )


def quantize_int4(weight: torch.Tensor, source: str, group_size: int) -> QuantizedTensor:
    """``weight`` ``[rows, cols]`` as 4-bit codes in groups of ``group_size`` along ``cols``,
    GGUF Q4_1's way: ``scale = (max - min) / 15``, ``code = round((w - min) / scale)``."""
    groups, rows, cols = _groups(weight, group_size, "int4")
    mins = groups.amin(dim=-1)
    scales = (groups.amax(dim=-1) - mins) / INT4_MAX
    steps = (groups - mins[..., None]) / _nonzero(scales)[..., None]
    codes = torch.where(scales[..., None] > 0, steps, 0).round().clamp(0, INT4_MAX)
    return QuantizedTensor(
        bits=4,
        codes=codes.to(torch.uint8).reshape(rows, cols),
        scales=scales,
        mins=mins,
        group_size=group_size,
        source=source,
    )


def _groups(weight: torch.Tensor, group_size: int, scheme: str) -> tuple[torch.Tensor, int, int]:
    """``weight`` in fp32 as ``[rows, groups, group_size]``."""
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(
            f"{scheme} quantization: {cols} input features are not whole groups of {group_size}"
        )
    return weight.float().reshape(rows, cols // group_size, group_size), rows, cols


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    return scales.clamp_min(torch.finfo(torch.float32).tiny)
