"""tests/fixtures/kquants.py: K-quant encodings that gguf's own dequantizers and files read back.

The error bound asserted is half of one quantization step of each sub-block, the step widened
only by what the format forces: the sub-block's 6-bit min (Q4_K, Q5_K) and scale are whole
multiples of the super-block's fp16 ``dmin`` and ``d``, so each may sit up to one such unit off
the sub-block's own range. That is about span/30 for Q4_K, span/62 for Q5_K (span = the
sub-block's max - min(min, 0)) and amax/62 = (2 * amax)/124 for Q6_K.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.fixtures.kquants import K_QUANT_TYPES, QK_K, quantize_k

Q4_K = gguf.GGMLQuantizationType.Q4_K
Q5_K = gguf.GGMLQuantizationType.Q5_K
Q6_K = gguf.GGMLQuantizationType.Q6_K
SHAPES = ((4, 256), (3, 512), (2, 1, 768))
SCALES = (0.02, 1.0, 5.0)


def _normal(shape: tuple[int, ...], scale: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _fp16_up(x: np.ndarray) -> np.ndarray:
    """An upper bound of the smallest fp16 >= ``x`` (relative rounding, or one subnormal step)."""
    return x * (1 + 2.0**-10) + 2.0**-24


def _error_bound(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Per-value bound of |dequantize(quantize_k(values)) - values|, same shape as ``values``."""
    blocks = values.reshape(-1, QK_K).astype(np.float64)
    if qtype == Q6_K:
        sub = blocks.reshape(len(blocks), 16, 16)
        amax = np.abs(sub).max(axis=-1)
        d = _fp16_up(amax.max(axis=-1, keepdims=True) / (31 * 127))
        half_step = (amax / 31 + d) / 2
    else:
        levels = 15 if qtype == Q4_K else 31
        sub = blocks.reshape(len(blocks), 8, 32)
        low = np.minimum(sub.min(axis=-1), 0.0)
        span = sub.max(axis=-1) - low
        dmin = _fp16_up(-low.min(axis=-1, keepdims=True) / 63)
        d = _fp16_up((span.max(axis=-1, keepdims=True) + dmin) / (levels * 63))
        half_step = ((span + dmin) / levels + d) / 2
    # float32 arithmetic in the dequantizer: a few ulps of the block's magnitude
    ulps = 8 * np.finfo(np.float32).eps * np.abs(blocks).max(axis=-1, keepdims=True)
    bound = np.repeat(half_step, sub.shape[-1], axis=-1).reshape(blocks.shape) + ulps
    return bound.reshape(values.shape)


def _assert_round_trip(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    data = quantize_k(values, qtype)
    out = gguf.quants.dequantize(data, qtype)
    assert out.shape == values.shape and out.dtype == np.float32
    assert np.isfinite(out).all()
    error = np.abs(out.astype(np.float64) - values)
    bound = _error_bound(values, qtype)
    assert (error <= bound).all(), f"{qtype.name}: worst error/bound {(error / bound).max():.3f}"
    return out


@pytest.mark.parametrize("qtype", K_QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("scale", SCALES)
def test_random_normal_round_trips_within_half_a_step(
    qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...], scale: float
) -> None:
    values = _normal(shape, scale)
    data = quantize_k(values, qtype)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert data.dtype == np.uint8
    assert data.shape == (*shape[:-1], shape[-1] // QK_K * type_size)
    assert gguf.quant_shape_from_byte_shape(data.shape, qtype) == shape
    _assert_round_trip(values, qtype)


@pytest.mark.parametrize("qtype", K_QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "transform",
    [lambda x: np.abs(x) + 1, lambda x: -np.abs(x) - 1, lambda x: x * 1e-6, lambda x: x * 1e4],
    ids=["positive", "negative", "tiny", "large"],
)
def test_one_signed_and_extreme_data_round_trip(
    qtype: gguf.GGMLQuantizationType, transform: Callable[[np.ndarray], np.ndarray]
) -> None:
    _assert_round_trip(transform(_normal((4, 512), 1.0, seed=1)).astype(np.float32), qtype)


@pytest.mark.parametrize("qtype", K_QUANT_TYPES, ids=lambda t: t.name)
def test_zero_blocks_and_sub_blocks_dequantize_to_exact_zeros(
    qtype: gguf.GGMLQuantizationType,
) -> None:
    zeros = np.zeros((2, 512), dtype=np.float32)
    assert not gguf.quants.dequantize(quantize_k(zeros, qtype), qtype).any()

    values = _normal((4, 256), 1.0, seed=2)
    values.reshape(4, 8, 32)[:, 1::3] = 0.0  # zero sub-blocks between random ones
    out = _assert_round_trip(values, qtype)
    assert not out.reshape(4, 8, 32)[:, 1::3].any()


def test_more_bits_means_smaller_errors() -> None:
    values = _normal((8, 512), 1.0, seed=3)
    worst = {
        t: np.abs(gguf.quants.dequantize(quantize_k(values, t), t) - values).max()
        for t in K_QUANT_TYPES
    }
    assert worst[Q6_K] < worst[Q5_K] < worst[Q4_K]


@pytest.mark.parametrize("qtype", K_QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "values",
    [
        np.ones((2, 255), np.float32),
        np.array([np.nan] + [0.0] * 255, np.float32),
        np.full((1, 256), 1e12, np.float32),  # d would overflow fp16
    ],
    ids=["ragged", "nan", "fp16-overflow"],
)
def test_rejects_values_it_cannot_encode(
    qtype: gguf.GGMLQuantizationType, values: np.ndarray
) -> None:
    with pytest.raises(ValueError):
        quantize_k(values, qtype)


def test_rejects_other_types() -> None:
    with pytest.raises(ValueError, match="Q8_0"):
        quantize_k(np.ones((1, 256), np.float32), gguf.GGMLQuantizationType.Q8_0)


@pytest.mark.parametrize("qtype", K_QUANT_TYPES, ids=lambda t: t.name)
def test_gguf_file_reads_back_the_same_values(
    qtype: gguf.GGMLQuantizationType, tmp_path: Path
) -> None:
    values = _normal((3, 512), 0.02, seed=4)
    data = quantize_k(values, qtype)
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_up.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    (tensor,) = gguf.GGUFReader(path).tensors
    assert tensor.name == "blk.0.ffn_up.weight"
    assert tensor.tensor_type == qtype
    assert tuple(int(n) for n in tensor.shape) == values.shape[::-1]  # ggml order: row length first
    read = gguf.quants.dequantize(np.asarray(tensor.data), qtype)
    np.testing.assert_array_equal(read, gguf.quants.dequantize(data, qtype))
    assert (np.abs(read - values) <= _error_bound(values, qtype)).all()
