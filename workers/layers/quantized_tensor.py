"""A checkpoint weight held as integers, as the loader hands it to a layer's weight loader:
``QuantizedTensor`` (codes, group scales, group minimums), unpacked so that a weight loader can
take its tensor-parallel rows or columns and a layer can join its parts before the matmul's
packing (``workers.layers.weight_quantizing``).

A weight ``[rows, cols]`` is cut along ``cols`` into groups of ``group_size`` values; each
group has a scale and, for asymmetric codes, a minimum:

* 4 bits: codes 0..15 (uint8, one per byte), ``w = scale * code + min`` (GGUF Q4_1's form;
  Q4_0 is ``min = -8 * scale``);
* 8 bits: codes -127..127 (int8), ``w = scale * code`` (GGUF Q8_0's form; per output channel
  when ``group_size == cols``).

Scales and minimums are fp32, so ``dequantize`` gives GGUF's own dequantization bit for bit
(``gguf.quants``: ``d * q + m`` in fp32, the product exact).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

BITS = (4, 8)
CODE_RANGES = {4: (0, 15), 8: (-127, 127)}
CODE_DTYPES = {4: torch.uint8, 8: torch.int8}


RowMap = Callable[[torch.Tensor], torch.Tensor]


class QuantizedShardError(ValueError):
    """A tensor-parallel split that would cut a quantization group in two."""


@dataclass(frozen=True)
class QuantizedTensor:
    """A ``[rows, cols]`` weight as integer codes with per-group scales (and minimums)."""

    bits: int  # 4 or 8
    codes: torch.Tensor  # [rows, cols]: uint8 0..15 (4 bits) or int8 (8 bits)
    scales: torch.Tensor  # [rows, cols / group_size] fp32
    mins: torch.Tensor | None  # [rows, cols / group_size] fp32; None: symmetric codes
    group_size: int
    source: str  # what the checkpoint stored ("Q4_1", "Q8_0", ...) or "float" (quantized here)

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"quantized tensor: {self.bits} bits (expected one of {BITS})")
        rows, cols = self.codes.shape
        if self.codes.dtype != CODE_DTYPES[self.bits]:
            raise ValueError(f"{self.bits}-bit codes must be {CODE_DTYPES[self.bits]}")
        groups = (rows, cols // self.group_size)
        if cols % self.group_size or tuple(self.scales.shape) != groups:
            raise ValueError(
                f"quantized tensor [{rows}, {cols}] in groups of {self.group_size}: scales "
                f"{tuple(self.scales.shape)} (expected {groups})"
            )
        if self.mins is not None and self.mins.shape != self.scales.shape:
            raise ValueError("quantized tensor: mins and scales differ in shape")

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.codes.shape
        return rows, cols

    @property
    def scheme(self) -> tuple[int, int, bool, str]:
        """What two tensors must share to be joined into one weight."""
        return self.bits, self.group_size, self.mins is not None, self.source

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Rows (``dim`` 0: any) or columns (``dim`` 1: whole groups only) ``[start,
        start + length)``."""
        if dim == 0:
            return self._map(lambda t: t.narrow(0, start, length))
        group = self.group_size
        first, count = start // group, length // group
        if start % group or length % group:
            raise QuantizedShardError(
                f"columns [{start}, {start + length}) of a {self.source} weight cut its groups "
                f"of {group} values: a tensor-parallel rank must hold whole groups"
            )
        return QuantizedTensor(
            bits=self.bits,
            codes=self.codes.narrow(1, start, length),
            scales=self.scales.narrow(1, first, count),
            mins=None if self.mins is None else self.mins.narrow(1, first, count),
            group_size=group,
            source=self.source,
        )

    def map_rows(self, reorder: RowMap) -> QuantizedTensor:
        """The same weight with its rows reordered by ``reorder`` (a function of a
        rows-first tensor: each of codes, scales and mins goes through it)."""
        return self._map(reorder)

    def _map(self, fn: RowMap) -> QuantizedTensor:
        return QuantizedTensor(
            bits=self.bits,
            codes=fn(self.codes),
            scales=fn(self.scales),
            mins=None if self.mins is None else fn(self.mins),
            group_size=self.group_size,
            source=self.source,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [rows, cols]
        """The weight as floats: computed in fp32, then cast to ``dtype``."""
        scales = self.scales.repeat_interleave(self.group_size, dim=1)
        weight = self.codes.float() * scales
        if self.mins is not None:
            weight = weight + self.mins.repeat_interleave(self.group_size, dim=1)
        return weight.to(dtype)


def cat_rows(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """``parts`` stacked along rows; they must share their scheme and column count."""
    first = parts[0]
    for part in parts[1:]:
        if part.scheme != first.scheme or part.shape[1] != first.shape[1]:
            raise ValueError(
                f"cannot join a {part.source} part [{part.shape}] to a {first.source} part "
                f"[{first.shape}]"
            )
    mins = [p.mins for p in parts]
    return QuantizedTensor(
        bits=first.bits,
        codes=torch.cat([p.codes for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        mins=None if first.mins is None else torch.cat([m for m in mins if m is not None]),
        group_size=first.group_size,
        source=first.source,
    )
