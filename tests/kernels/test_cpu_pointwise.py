"""shoal's C kernels for a layer's row-wise ops on the CPU (``kernels/cpu/layer_pointwise.c``):
each against its torch reference (bf16 bit for bit where the reference's roundings are
reproduced), the layouts it takes and refuses, its bounds checks, and ``kernels.ops`` handing
CPU tensors to it."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import cpu_build, cpu_pointwise, ops
from shoal.kernels.activation import silu_and_mul_torch
from shoal.kernels.kv_write import write_kv_torch
from shoal.kernels.rms_norm import rms_norm_torch
from shoal.kernels.rotary import apply_rotary_torch, build_cos_sin_cache
from shoal.workers.cpu_info import cpu_flags

needs_kernel = pytest.mark.skipif(
    cpu_build.load_kernel_library(cpu_pointwise.LIBRARY) is None,
    reason="no C compiler here: the kernels cannot be built",
)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}


def _check(got: torch.Tensor, want: torch.Tensor, *, bf16_exact: bool = True) -> None:
    """bf16 outputs equal (the reference's roundings are the kernel's); fp32 within an ulp or
    two (the sum of squares and exp differ in order and last bit)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16 and bf16_exact:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **FP32_TOL)


@needs_kernel
@DTYPES
@pytest.mark.parametrize("rows", [1, 5, 96])
@pytest.mark.parametrize("hidden", [200, 576])  # 576: whole 16-lane vectors (AVX-512's path)
def test_rms_norm_with_and_without_residual_is_the_reference(dtype, rows, hidden):
    torch.manual_seed(rows)
    x, residual = torch.randn(rows, hidden, dtype=dtype), torch.randn(rows, hidden, dtype=dtype)
    weight = torch.rand(hidden, dtype=dtype) + 0.5
    got = cpu_pointwise.rms_norm_cpu(x, weight, 1e-6)
    assert got is not None
    _check(got, rms_norm_torch(x, weight, 1e-6), bf16_exact=rows == 1)
    pair = cpu_pointwise.rms_norm_cpu(x, weight, 1e-6, residual)
    want_out, want_sum = rms_norm_torch(x, weight, 1e-6, residual)
    assert isinstance(pair, tuple)
    assert torch.equal(pair[1], want_sum)  # the new residual is one add, rounded as torch
    _check(pair[0], want_out, bf16_exact=rows == 1)


@needs_kernel
def test_a_build_without_bf16_conversions_rounds_to_the_same_bits(fresh_build, monkeypatch):
    """vector_math.h rounds 16 lanes to bf16 with the CPU's conversion instruction where it has
    AVX512-BF16 and with integer arithmetic elsewhere (SHOAL_KERNEL_ARCH=skylake-avx512): the
    two builds' RMSNorm with the residual add, which rounds three times a value, agree bit for
    bit, halfway cases (to even) included."""
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("the CPU has no AVX512-BF16")
    torch.manual_seed(0)
    x, residual = torch.randn(96, 576).bfloat16(), torch.randn(96, 576).bfloat16()
    x[0], residual[0] = 1.0, 2.0**-8  # sums exactly halfway between two bf16 values
    x[1], residual[1] = 1.0 + 2.0**-7, 2.0**-8
    weight = torch.rand(576).bfloat16() + 0.5
    native = cpu_pointwise.rms_norm_cpu(x, weight, 1e-6, residual)
    monkeypatch.setenv("SHOAL_KERNEL_ARCH", "skylake-avx512")
    cpu_build.load_kernel_library.cache_clear()
    emulated = cpu_pointwise.rms_norm_cpu(x, weight, 1e-6, residual)
    assert isinstance(native, tuple) and isinstance(emulated, tuple)
    assert len(list(fresh_build.glob(f"{cpu_pointwise.LIBRARY}-*.so"))) == 2
    assert torch.equal(native[1][:2, 0], torch.tensor([1.0, 1.0 + 2.0**-6]).bfloat16())
    assert torch.equal(native[1], emulated[1]) and torch.equal(native[0], emulated[0])


@needs_kernel
@DTYPES
def test_rms_norm_reads_rows_of_a_strided_view_and_per_head_rows(dtype):
    """A column slice of a wider tensor (rows apart by its width) and Qwen3's per-head norm
    ([tokens, heads, head_dim] contiguous) both go through the kernel."""
    wide = torch.randn(7, 300, dtype=dtype)
    view, weight = wide[:, :128], torch.rand(128, dtype=dtype)
    got = cpu_pointwise.rms_norm_cpu(view, weight, 1e-5)
    assert got is not None and got.is_contiguous()
    _check(got, rms_norm_torch(view, weight, 1e-5), bf16_exact=False)
    heads = torch.randn(3, 4, 64, dtype=dtype)
    got = cpu_pointwise.rms_norm_cpu(heads, torch.rand(64, dtype=dtype), 1e-5)
    assert got is not None and got.shape == heads.shape


def _qkv(tokens: int, dtype: torch.dtype, heads=(4, 2), head_dim=64):  # type: ignore[no-untyped-def]
    """q and k as the attention layer has them: views of one fused projection's output."""
    q_heads, kv_heads = heads
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    shape = (tokens, -1, head_dim)
    return q.reshape(shape), k.reshape(shape), v.reshape(shape)


@needs_kernel
@DTYPES
@pytest.mark.parametrize(
    ("rotary_dim", "is_neox"),
    [(64, True), (64, False), (32, True)],
    ids=["neox", "gptj", "partial"],
)
def test_rotary_is_the_reference_bit_for_bit(dtype, rotary_dim, is_neox):
    torch.manual_seed(rotary_dim)
    q, k, _ = _qkv(9, dtype)
    cache = build_cos_sin_cache(rotary_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (9,))
    got = cpu_pointwise.apply_rotary_cpu(q, k, positions, cache, is_neox)
    want = apply_rotary_torch(q, k, positions, cache, is_neox)
    assert got is not None
    for g, w in zip(got, want, strict=True):
        assert g.is_contiguous()
        assert torch.equal(g, w)


@needs_kernel
def test_rotary_refuses_a_position_outside_its_cache():
    q, k, _ = _qkv(2, torch.float32)
    cache = build_cos_sin_cache(64, 16, 10000.0)
    with pytest.raises(IndexError, match="outside the cache of 16"):
        cpu_pointwise.apply_rotary_cpu(q, k, torch.tensor([3, 16]), cache)


@needs_kernel
@DTYPES
@pytest.mark.parametrize("rows", [1, 4, 80])
def test_silu_and_mul_is_the_reference(dtype, rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * 700, dtype=dtype) * 6  # past both tails of the exp
    got = cpu_pointwise.silu_and_mul_cpu(x)
    assert got is not None
    _check(got, silu_and_mul_torch(x))


@needs_kernel
@DTYPES
def test_write_kv_fills_the_slots_the_reference_fills_and_skips_negative_ones(dtype):
    _, k, v = _qkv(6, dtype)  # v strided as the attention layer passes it
    caches = [torch.zeros(5, 4, 2, 64, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([3, -1, 19, 0, 7, -1])
    assert cpu_pointwise.write_kv_cpu(k.contiguous(), v, caches[0], caches[1], slots)
    write_kv_torch(k.contiguous(), v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].flatten(0, 1)[[3, 19, 0, 7]].abs().sum() > 0


@needs_kernel
def test_write_kv_refuses_a_slot_past_the_cache():
    _, k, v = _qkv(2, torch.float32)
    cache = torch.zeros(2, 4, 2, 64)
    with pytest.raises(IndexError, match="past the cache's 8"):
        cpu_pointwise.write_kv_cpu(k.contiguous(), v, cache, cache.clone(), torch.tensor([1, 8]))


def test_inputs_the_kernels_do_not_take_are_left_to_the_references():
    half = torch.randn(3, 64, dtype=torch.float16)
    assert cpu_pointwise.rms_norm_cpu(half, torch.ones(64, dtype=torch.float16), 1e-5) is None
    mixed = cpu_pointwise.rms_norm_cpu(
        torch.randn(3, 64), torch.ones(64, dtype=torch.bfloat16), 1e-5
    )
    assert mixed is None
    transposed = torch.randn(64, 3).t()  # rows not contiguous
    assert cpu_pointwise.silu_and_mul_cpu(transposed) is None
    q, k, _ = _qkv(2, torch.float32)
    fp16_cache = build_cos_sin_cache(64, 16, 10000.0).half()
    assert cpu_pointwise.apply_rotary_cpu(q, k, torch.tensor([0, 1]), fp16_cache) is None


@needs_kernel
def test_ops_hand_cpu_tensors_to_the_kernels_unless_forced_to_torch(monkeypatch):
    calls: list[str] = []
    real = cpu_pointwise.load_kernel_library

    def counting(name, signatures=()):  # type: ignore[no-untyped-def]
        calls.append(name)
        return real(name, signatures)

    monkeypatch.setattr(cpu_pointwise, "load_kernel_library", counting)
    x = torch.randn(2, 2 * 32)
    ops.silu_and_mul(x)
    ops.rms_norm(x, torch.ones(64), 1e-5)
    assert calls == [cpu_pointwise.LIBRARY] * 2
    monkeypatch.setenv("SHOAL_KERNELS", "torch")
    torch.testing.assert_close(ops.silu_and_mul(x), silu_and_mul_torch(x))
    assert len(calls) == 2
