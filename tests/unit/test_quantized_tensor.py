"""Quantized checkpoint tensors before the matmul packs them: GGUF's Q4_0/Q4_1/Q8_0 blocks read
as codes and scales that dequantize exactly as ``gguf.quants`` does; tensor-parallel narrowing
(rows freely, columns in whole groups only); the quantizers of ``--quantization``; the parts of a
fused weight joined, or dequantized when they do not make one quantized weight."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from shoal.workers.gguf.quantized_blocks import read_blocks
from shoal.workers.layers.quantize import quantize_int4, quantize_int8
from shoal.workers.layers.quantized_parts import QuantizedParts
from shoal.workers.layers.quantized_tensor import QuantizedShardError, QuantizedTensor


def _gguf_tensor(kind: str, rows: int = 6, cols: int = 96, seed: int = 0):  # type: ignore[no-untyped-def]
    """(the blocks gguf writes for a random matrix, gguf's own dequantization of them)."""
    rng = np.random.default_rng(seed)
    array = (rng.standard_normal((rows, cols)) * 0.3).astype(np.float32)
    array[0, :32] = 0.25  # a constant block
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = gguf.quants.quantize(array, qtype)
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))


@pytest.mark.parametrize(("kind", "bits"), [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4)])
def test_gguf_blocks_read_as_codes_dequantize_as_gguf_does(kind, bits):
    blocks, expected = _gguf_tensor(kind)
    tensor = read_blocks(blocks.reshape(-1), kind, (6, 96))
    assert (tensor.bits, tensor.group_size, tensor.shape, tensor.source) == (
        bits,
        32,
        (6, 96),
        kind,
    )
    assert tensor.scales.shape == (6, 3) and (tensor.mins is None) == (kind == "Q8_0")
    assert torch.equal(tensor.dequantize(), expected)


def test_blocks_other_than_the_kept_types_are_refused():
    blocks, _ = _gguf_tensor("Q5_0")
    with pytest.raises(ValueError, match="Q5_0 blocks are not read as codes"):
        read_blocks(blocks.reshape(-1), "Q5_0", (6, 96))


def test_rows_narrow_freely_and_columns_in_whole_groups():
    blocks, dense = _gguf_tensor("Q4_1")
    tensor = read_blocks(blocks.reshape(-1), "Q4_1", (6, 96))
    assert torch.equal(tensor.narrow(0, 1, 4).dequantize(), dense[1:5])
    assert torch.equal(tensor.narrow(1, 32, 64).dequantize(), dense[:, 32:])
    with pytest.raises(QuantizedShardError, match=r"columns \[0, 48\) of a Q4_1 weight cut"):
        tensor.narrow(1, 0, 48)
    reversed_rows = tensor.map_rows(lambda rows: rows.flip(0))
    assert torch.equal(reversed_rows.dequantize(), dense.flip(0))


def test_int8_quantization_is_symmetric_per_group_within_half_a_step():
    weight = torch.randn(8, 64)
    weight[3, 32:] = 0  # an all-zero group keeps scale 0
    q = quantize_int8(weight, "float32", 32)
    assert (q.bits, q.group_size, q.mins, q.scales.shape) == (8, 32, None, (8, 2))
    peaks = q.codes.abs().reshape(8, 2, 32).amax(dim=-1)
    assert peaks[3, 1] == 0 and (peaks.flatten()[peaks.flatten() != 0] == 127).all()
    steps = q.scales.repeat_interleave(32, 1)
    assert ((q.dequantize() - weight).abs() <= steps / 2 + 1e-7).all()
    with pytest.raises(ValueError, match="int8 quantization: 48 input features"):
        quantize_int8(torch.randn(4, 48), "float32", 32)


def test_int4_quantization_spans_each_group_min_to_max():
    weight = torch.randn(4, 64)
    weight[1, 32:] = -0.5  # a constant group comes back exactly
    q = quantize_int4(weight, "float32", 32)
    assert (q.bits, q.group_size, q.scales.shape) == (4, 32, (4, 2))
    assert q.codes.max() == 15 and q.codes.min() == 0
    steps = q.scales.repeat_interleave(32, 1)
    assert ((q.dequantize() - weight).abs() <= steps / 2 + 1e-6).all()
    assert torch.equal(q.dequantize()[1, 32:], weight[1, 32:])
    with pytest.raises(ValueError, match="48 input features are not whole groups of 32"):
        quantize_int4(torch.randn(4, 48), "float32", 32)


def _part(rows: int, source: str = "Q4_1", bits: int = 4) -> QuantizedTensor:
    return QuantizedTensor(
        bits=bits,
        codes=torch.randint(0, 15, (rows, 64), dtype=torch.uint8 if bits == 4 else torch.int8),
        scales=torch.rand(rows, 2),
        mins=torch.rand(rows, 2) if bits == 4 else None,
        group_size=32,
        source=source,
    )


def test_parts_join_only_when_they_cover_every_row_in_one_scheme():
    q, k, v = _part(4), _part(2), _part(2)
    parts = QuantizedParts(8)
    parts.put(6, v)
    parts.put(0, q)
    assert parts.joined() is None  # rows 4..5 missing
    parts.put(4, k)
    joined = parts.joined()
    assert joined is not None
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in (q, k, v)]))
    parts.put(4, _part(2, source="Q4_0"))
    assert parts.joined() is None  # two schemes: dequantized instead
    dense = torch.zeros(8, 64)
    parts.spill_into(dense)
    assert torch.equal(dense[:4], q.dequantize()) and torch.equal(dense[6:], v.dequantize())
    parts.discard(4)
    assert parts.joined() is None and parts
    parts.clear()
    assert not parts
