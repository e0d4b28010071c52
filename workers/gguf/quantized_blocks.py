"""GGUF's Q4_0, Q4_1 and Q8_0 blocks read as integer codes with their scales
(``QuantizedTensor``), for weights kept quantized instead of dequantized at load.

Each block holds 32 consecutive values of a row (ggml's ``block_q4_0`` etc.):

* Q8_0 (34 bytes): fp16 ``d``, 32 int8 ``q``; ``w = d * q``.
* Q4_0 (18 bytes): fp16 ``d``, 16 bytes of nibbles (values 0..15 in the low nibbles, 16..31 in
  the high ones); ``w = d * (q - 8)``: codes ``q``, minimum ``-8 d``.
* Q4_1 (20 bytes): fp16 ``d``, fp16 ``m``, nibbles as Q4_0; ``w = d * q + m``.

The codes, scales and minimums are the file's own (fp16 widened to fp32), so dequantizing the
result equals ``gguf.quants.dequantize`` bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from shoal.workers.layers.quantized_tensor import QuantizedTensor

BLOCK_VALUES = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
KEPT_TYPES = tuple(BLOCK_BYTES)


def read_blocks(data: np.ndarray, kind: str, shape: tuple[int, ...]) -> QuantizedTensor:
    """The bytes of one ``kind`` tensor of ``shape`` (``[rows, cols]``, numpy order) as codes,
    scales and minimums."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"{kind} blocks are not read as codes (only {', '.join(KEPT_TYPES)})")
    rows, cols = shape
    if cols % BLOCK_VALUES:
        raise ValueError(f"{kind} rows of {cols} values are not whole blocks of {BLOCK_VALUES}")
    blocks = data.reshape(rows, cols // BLOCK_VALUES, BLOCK_BYTES[kind])
    scales = _fp16(blocks[..., 0:2])
    if kind == "Q8_0":
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(rows, cols))
        return QuantizedTensor(
            bits=8, codes=codes, scales=scales, mins=None, group_size=BLOCK_VALUES, source=kind
        )
    if kind == "Q4_0":
        mins = -8 * scales
        nibbles = blocks[..., 2:]
    else:
        mins = _fp16(blocks[..., 2:4])
        nibbles = blocks[..., 4:]
    return QuantizedTensor(
        bits=4,
        codes=_unpack_nibbles(nibbles).reshape(rows, cols),
        scales=scales,
        mins=mins,
        group_size=BLOCK_VALUES,
        source=kind,
    )


def _fp16(two_bytes: np.ndarray) -> torch.Tensor:  # [..., 2] uint8 -> [...] fp32
    values = np.ascontiguousarray(two_bytes).view(np.float16)[..., 0]
    return torch.from_numpy(values.astype(np.float32))


def _unpack_nibbles(nibbles: np.ndarray) -> torch.Tensor:
    """``[..., 16]`` bytes → ``[..., 32]`` codes: the low nibbles, then the high ones."""
    packed = torch.from_numpy(np.ascontiguousarray(nibbles))
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)
