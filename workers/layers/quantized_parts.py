"""The quantized rows a linear weight's loader received, kept until the weight is complete.

A fused weight (q/k/v, gate/up) is loaded part by part; when a part comes as a
``QuantizedTensor`` its rows are kept here, by the first row they fill, instead of being
dequantized into the float parameter. After loading (``workers.layers.weight_quantizing``),
parts that cover every row of one scheme are joined into one quantized weight; otherwise (some
rows came as floats, or parts of different schemes) each part is dequantized into its rows.
"""

from __future__ import annotations

import torch

from shoal.workers.layers.quantized_tensor import QuantizedTensor, cat_rows


class QuantizedParts:
    """Row offset → the quantized rows loaded there, for one ``[rows, cols]`` weight."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._parts: dict[int, QuantizedTensor] = {}

    def __bool__(self) -> bool:
        return bool(self._parts)

    def put(self, first_row: int, part: QuantizedTensor) -> None:
        self._parts[first_row] = part

    def discard(self, first_row: int) -> None:
        """Rows from ``first_row`` were loaded as floats: forget a quantized part there."""
        self._parts.pop(first_row, None)

    def joined(self) -> QuantizedTensor | None:
        """Every row as one quantized tensor, or None when the parts do not cover all rows
        back to back or differ in scheme."""
        ordered = sorted(self._parts.items())
        expected = 0
        for first_row, part in ordered:
            if first_row != expected:
                return None
            expected += part.shape[0]
        schemes = {part.scheme for _, part in ordered}
        if expected != self.rows or len(schemes) != 1:
            return None
        return cat_rows([part for _, part in ordered])

    def spill_into(self, dense: torch.Tensor) -> None:
        """Dequantize each part into its rows of ``dense`` ``[rows, cols]``."""
        with torch.no_grad():
            for first_row, part in self._parts.items():
                dense.narrow(0, first_row, part.shape[0]).copy_(part.dequantize())

    def clear(self) -> None:
        self._parts.clear()
