"""The weight-only quantized matmuls (``kernels.quant_gemm``), through ``gemm.linear``, against
the same integer codes dequantized and multiplied in fp32: int4 (a scale and a minimum per
group) and int8 (a scale per group, run as two 4-bit halves), in the default bf16 kernel and
the exact fp32 one (``SHOAL_QUANT_DTYPE``), output rows padded to the kernel's block, any
leading shape, a bias, activations of any float dtype. torch's int4 dequantization
(``scale * (q - 8) + zero``) is checked bit for bit: in fp32, multiplying by the identity
returns exactly the weight the codes stand for (fp16 scales and minimums, as GGUF stores)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.kernels import gemm, quant_gemm
from shoal.kernels.quant_gemm import QuantizedWeight, pack_int4, pack_int8

# Max |error| / max |reference| of a product: fp32 is rounding only; bf16 rounds activations,
# scales and the output to 8 bits of mantissa.
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
COMPUTE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(params=sorted(COMPUTE))
def compute(request, monkeypatch) -> torch.dtype:  # type: ignore[no-untyped-def]
    """The kernel's dtype, chosen by ``SHOAL_QUANT_DTYPE`` when a weight is packed."""
    monkeypatch.setenv(quant_gemm.ENV_VAR, request.param)
    return COMPUTE[request.param]


def _int8_case(gen: torch.Generator, rows: int, cols: int, group: int):  # type: ignore[no-untyped-def]
    codes = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8)
    scales = (torch.rand(rows, cols // group, generator=gen) * 0.01 + 0.001).half().float()
    return codes, scales


def _int4_case(gen: torch.Generator, rows: int, cols: int, group: int):  # type: ignore[no-untyped-def]
    """Codes, and fp16-representable scales and minimums (as a GGUF Q4_1 block holds)."""
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(rows, cols // group, generator=gen) * 0.02 + 0.001).half().float()
    mins = (-8 * scales + torch.randn(rows, cols // group, generator=gen) * 0.01).half().float()
    return codes, scales, mins


def _expand(per_group: torch.Tensor, group: int) -> torch.Tensor:
    return per_group.repeat_interleave(group, 1)


def _check(weight: QuantizedWeight, dense: torch.Tensor, compute: torch.dtype, x_dtype) -> None:  # type: ignore[no-untyped-def]
    """``gemm.linear`` on ``weight`` against ``F.linear`` in fp32 on ``dense``."""
    gen = torch.Generator().manual_seed(7)
    rows, cols = dense.shape
    bias = torch.randn(rows, generator=gen).to(x_dtype)
    for leading in [(0,), (1,), (9,), (2, 3)]:
        x = torch.randn(*leading, cols, generator=gen).to(x_dtype)
        for b in (None, bias):
            expected = F.linear(x.float(), dense, None if b is None else b.float())
            out = gemm.linear(x, weight, b)
            assert out.dtype == x_dtype and out.shape == expected.shape
            if expected.numel():
                error = (out.float() - expected).abs().max() / expected.abs().max()
                assert error <= BOUNDS[compute], f"{leading}: relative error {error:.2e}"


@pytest.mark.parametrize(("rows", "group"), [(64, 32), (40, 32), (48, 128)])
def test_int4_equals_its_codes_dequantized(rows, group, compute):
    """40 output rows are not whole blocks of 16: padded with zero rows, then cut back."""
    codes, scales, mins = _int4_case(torch.Generator().manual_seed(1), rows, 256, group)
    weight = pack_int4(codes, scales, mins, group)
    assert (weight.bits, weight.shape, weight.dtype) == (4, (rows, 256), compute)
    assert weight.packed.dtype == torch.uint8
    dense = codes.float() * _expand(scales, group) + _expand(mins, group)
    _check(weight, dense, compute, torch.float32)


@pytest.mark.parametrize(("rows", "group"), [(64, 32), (40, 64)])
def test_int8_equals_its_codes_dequantized(rows, group, compute):
    codes, scales = _int8_case(torch.Generator().manual_seed(2), rows, 128, group)
    weight = pack_int8(codes, scales, group)
    assert (weight.bits, weight.shape, weight.dtype) == (8, (rows, 128), compute)
    _check(weight, codes.float() * _expand(scales, group), compute, torch.float32)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_half_activations_come_back_in_their_dtype(x_dtype, compute):
    codes, scales, mins = _int4_case(torch.Generator().manual_seed(3), 32, 64, 32)
    weight = pack_int4(codes, scales, mins, 32)
    _check(weight, codes.float() * _expand(scales, 32) + _expand(mins, 32), torch.bfloat16, x_dtype)


def test_fp32_dequantizes_exactly_as_scale_times_code_plus_min(monkeypatch):
    """The identity picks each weight out of the kernel: fp16 scales and minimums (a GGUF
    block's) come back bit for bit, in Q4_0's form (``min = -8 * scale``), Q4_1's and Q8_0's."""
    monkeypatch.setenv(quant_gemm.ENV_VAR, "float32")
    gen = torch.Generator().manual_seed(4)
    codes, scales, mins = _int4_case(gen, 48, 128, 32)
    identity = torch.eye(128)
    for m in (mins, -8 * scales):
        seen = gemm.linear(identity, pack_int4(codes, scales, m, 32)).t()
        assert torch.equal(seen, codes.float() * _expand(scales, 32) + _expand(m, 32))
    int8_codes, int8_scales = _int8_case(gen, 48, 128, 32)
    seen = gemm.linear(identity, pack_int8(int8_codes, int8_scales, 32)).t()
    assert torch.equal(seen, int8_codes.float() * _expand(int8_scales, 32))


def test_bf16_rounds_only_the_scales_and_zeros(monkeypatch):
    """With the bf16 kernel the weight seen through the identity is the codes times bf16 scales
    plus bf16 zeros, computed in fp32 (then the output rounded to bf16)."""
    monkeypatch.setenv(quant_gemm.ENV_VAR, "bfloat16")
    codes, scales, mins = _int4_case(torch.Generator().manual_seed(5), 32, 64, 32)
    seen = gemm.linear(torch.eye(64), pack_int4(codes, scales, mins, 32)).t()
    s = scales.bfloat16().float()
    z = (mins + 8 * scales).bfloat16().float()
    expected = (codes.float() - 8) * _expand(s, 32) + _expand(z, 32)
    assert torch.equal(seen, expected.bfloat16().float())


def test_the_kernel_runs_in_bf16_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv(quant_gemm.ENV_VAR, raising=False)
    codes, scales, mins = _int4_case(torch.Generator().manual_seed(9), 16, 32, 32)
    assert pack_int4(codes, scales, mins, 32).dtype == torch.bfloat16
    monkeypatch.setenv(quant_gemm.ENV_VAR, "float32")
    assert pack_int4(codes, scales, mins, 32).dtype == torch.float32


def test_weights_the_kernel_cannot_take_are_refused(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    codes, scales, mins = _int4_case(gen, 32, 96, 32)
    with pytest.raises(ValueError, match="groups of 32, 64, 128, 256 that divide them"):
        pack_int4(codes, scales[:, :2], mins[:, :2], 48)
    with pytest.raises(ValueError, match=r"scales \(32, 2\), expected one per group of 32"):
        pack_int4(codes, scales[:, :2], mins[:, :2], 32)
    with pytest.raises(ValueError, match=r"codes are torch\.int16"):
        pack_int8(codes.to(torch.int16), scales, 32)
    monkeypatch.setenv(quant_gemm.ENV_VAR, "float64")
    with pytest.raises(ValueError, match="SHOAL_QUANT_DTYPE='float64'"):
        pack_int4(codes, scales, mins, 32)


def test_a_quantized_weight_reads_a_fraction_of_the_dense_bytes(monkeypatch):
    """bf16 scales: int4 reads 0.625 byte per weight, int8 (two halves, each with its scales
    and zeros) 1.25."""
    monkeypatch.setenv(quant_gemm.ENV_VAR, "bfloat16")
    gen = torch.Generator().manual_seed(8)
    int4 = pack_int4(*_int4_case(gen, 64, 256, 32), 32)
    int8 = pack_int8(*_int8_case(gen, 64, 256, 32), 32)
    weights = 64 * 256
    assert int4.nbytes == weights * 5 // 8 and int8.nbytes == weights * 5 // 4
