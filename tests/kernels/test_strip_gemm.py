"""shoal's strip matmul on the CPU (``kernels/cpu/strip_gemm.c``): float and 4-bit products
against fp64 at every row-tile and strip edge, with and without bias and on strided inputs, bf16
on the matrix units (AMX) and on the vector path, bf16's rounding of the results, the packing's
round trip, and the builds without its vector or matrix paths (the backend falls back to oneDNN
there, 4-bit codes to torch's kernel, bf16 without AMX to the vector path)."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import gemm, ops, strip_gemm
from shoal.kernels.strip_gemm import (
    code_strips_available,
    decoded_code_products,
    matrix_unit_products,
    pack_int4_strips,
    pack_int8_strips,
    pack_strips,
    strip_codes_linear,
    strip_gated_linear,
    strip_gemm_available,
    strip_linear,
    use_matrix_units,
)
from shoal.workers.cpu_info import cpu_flags

DTYPES = [torch.float32, torch.bfloat16]


def _needs_path(dtype: torch.dtype) -> None:
    if not strip_gemm_available(dtype):
        pytest.skip(f"the strip kernel has no {dtype} path on this CPU")


def _reference(x, weight, bias):  # type: ignore[no-untyped-def]
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def _check(out: torch.Tensor, x, weight, bias) -> None:  # type: ignore[no-untyped-def]
    """Within fp32 accumulation of the products (fp32), or one bf16 rounding of the result."""
    expected = _reference(x, weight, bias)
    assert out.dtype == x.dtype and out.shape == expected.shape
    scale = float(x.double().abs().sum(-1).max(-1).values.clamp(min=1) if len(x) else 1.0)
    scale *= float(weight.double().abs().amax())
    if x.dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, atol=1e-6 * scale, rtol=1e-5)
    else:
        torch.testing.assert_close(out.double(), expected, atol=1e-5 * scale, rtol=2**-8)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 9, 64, 65, 150])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (50, 40), (96, 200)])
def test_products_match_fp64_at_every_tile_edge(dtype, rows, out_features, in_features):
    """Row counts across the 8-row tiles and 64-row blocks; output sizes of one strip, an odd
    last strip (50 = 3 strips + 2), and strips in pairs."""
    _needs_path(dtype)
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    packed = pack_strips(weight)
    for b in (None, bias):
        _check(strip_linear(x, packed, b), x, weight, b)


@pytest.fixture(params=[True, False], ids=["matrix-units", "vector"])
def bf16_path(request):  # type: ignore[no-untyped-def]
    """bf16 products on the matrix units (skipped where the CPU, the build or the OS has none)
    or on the vector path; the matrix units back on afterwards, as a process starts."""
    _needs_path(torch.bfloat16)
    if use_matrix_units(request.param) != request.param:
        pytest.skip("no AMX path on this CPU")
    yield request.param
    use_matrix_units(True)


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 70, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (40, 96), (50, 160)])
def test_bf16_products_on_either_path_match_fp64(bf16_path, rows, out_features, in_features):
    """Rows across AMX's 16-row tiles, 32-row blocks and 128-row chunks; one strip, a pair and
    a lone last strip (40), a cut last strip (50); inputs in whole 32-input tile steps. Counted
    where they ran: every product on the matrix units when they are on, none when off."""
    gen = torch.Generator().manual_seed(rows * 5 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    packed, before = pack_strips(weight), matrix_unit_products()
    for b in (None, bias):
        _check(strip_linear(x, packed, b), x, weight, b)
    assert matrix_unit_products() - before == (2 if bf16_path else 0)


def test_inputs_off_amx_s_step_stay_on_the_vector_path(bf16_path):
    """An input size that is not whole 32-input steps (40) cannot take tile products."""
    weight, x = torch.randn(24, 40).bfloat16(), torch.randn(20, 40).bfloat16()
    before = matrix_unit_products()
    _check(strip_linear(x, pack_strips(weight)), x, weight, None)
    assert matrix_unit_products() == before


def test_bf16_results_are_rounded_as_torch_rounds(bf16_path):
    """Each output the exact fp32 sum of two inputs in [1, 4) (a weight of two ones a row): the
    kernel's one rounding to bf16 must be torch's (to nearest, ties to even) bit for bit; a NaN
    input gives NaN outputs."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.rand(40, 64, generator=gen) * 3 + 1).bfloat16()
    pairs = torch.randint(0, 64, (48, 2), generator=gen)
    weight = torch.zeros(48, 64)
    weight[torch.arange(48), pairs[:, 0]] += 1.0
    weight[torch.arange(48), pairs[:, 1]] += 1.0
    expected = (x.float() @ weight.T).bfloat16()  # exact in fp32, then one rounding
    out = strip_linear(x, pack_strips(weight.bfloat16()))
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    x[5, pairs[7, 0]] = float("nan")
    assert strip_linear(x, pack_strips(weight.bfloat16()))[5, 7].isnan()


@pytest.mark.parametrize("rows", [1, 16, 17, 40, 300])
@pytest.mark.parametrize(("inter", "in_features"), [(16, 32), (48, 64), (80, 160)])
def test_gated_products_are_the_two_calls_bit_for_bit(bf16_path, rows, inter, in_features):
    """silu(gate) * up in one call (a gated MLP's fused projection, gate rows then up): on the
    matrix units the same bits as the strip product followed by the C silu_and_mul, counted
    there; elsewhere no answer (None) and ``gemm.gated_linear`` makes the two calls."""
    gen = torch.Generator().manual_seed(rows + inter)
    weight = (torch.randn(2 * inter, in_features, generator=gen) * 0.3).bfloat16()
    bias = torch.randn(2 * inter, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    packed = pack_strips(weight)
    for b in (None, bias):
        two_calls = ops.silu_and_mul(strip_linear(x, packed, b))
        before = matrix_unit_products()
        fused = strip_gated_linear(x, packed, b)
        assert (fused is not None) == bf16_path
        assert matrix_unit_products() - before == int(bf16_path)
        assert torch.equal(
            gemm.gated_linear(x, packed, b).view(torch.int16), two_calls.view(torch.int16)
        )


def test_gated_products_off_the_tiles_take_the_two_calls(bf16_path):
    """An input size off the 32-input step, or gate rows that are not whole strips."""
    for inter, in_features in ((16, 40), (24, 64)):
        weight, x = torch.randn(2 * inter, in_features).bfloat16(), torch.randn(5, in_features)
        packed = pack_strips(weight)
        assert strip_gated_linear(x.bfloat16(), packed) is None
        expected = ops.silu_and_mul(strip_linear(x.bfloat16(), packed))
        assert torch.equal(gemm.gated_linear(x.bfloat16(), packed), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_strided_and_batched_inputs(dtype):
    _needs_path(dtype)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 64, generator=gen).to(dtype)
    wide = torch.randn(11, 128, generator=gen).to(dtype)
    rows = wide[:, 32:96]  # rows 128 elements apart
    _check(strip_linear(rows, pack_strips(weight), None), rows, weight, None)
    batched = torch.randn(3, 5, 64, generator=gen).to(dtype)
    out = strip_linear(batched, pack_strips(weight))
    assert out.shape == (3, 5, 40)
    _check(out.reshape(15, 40), batched.reshape(15, 64), weight, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_packing_round_trips_and_refuses_other_dtypes(dtype):
    _needs_path(dtype)
    weight = torch.randn(37, 24).to(dtype)
    packed = pack_strips(weight)
    assert packed.shape == (37, 24) and packed.dtype == dtype
    assert packed.packed.shape[0] == 3  # 37 rows in strips of 16
    assert packed.nbytes == 3 * 16 * 24 * weight.element_size()  # the padded strips are read
    assert torch.equal(packed.to_dense(), weight)
    with pytest.raises(TypeError, match="strip matmul"):
        strip_linear(torch.randn(2, 24, dtype=torch.float16), packed)


def test_odd_inputs_in_bf16_go_to_onednn_and_still_answer():
    """bf16's kernel takes the input in pairs: a weight with an odd input size gets oneDNN's
    packing under the strips backend."""
    _needs_path(torch.bfloat16)
    weight = torch.randn(20, 33).bfloat16()
    prepared = gemm.pack_weight(weight, gemm.STRIPS)
    assert isinstance(prepared, torch.Tensor) and prepared.is_mkldnn
    x = torch.randn(4, 33).bfloat16()
    _check(gemm.linear(x, prepared), x, weight, None)


@pytest.mark.parametrize(
    ("arch", "flag", "fp32_path"),
    [("x86-64-v3", "avx2", False), ("skylake-avx512", "avx512f", True)],
    ids=["avx2", "avx512f"],
)
def test_builds_without_a_vector_path_leave_the_dtype_to_onednn(
    fresh_build, monkeypatch, arch, flag, fp32_path
):
    """SHOAL_KERNEL_ARCH: without AVX-512 the kernel has no path (oneDNN for both dtypes);
    AVX-512 without AVX512-BF16 has fp32's only, which still answers right."""
    if flag not in cpu_flags():
        pytest.skip(f"the CPU has no {flag}")
    monkeypatch.setenv("SHOAL_KERNEL_ARCH", arch)
    monkeypatch.delenv(gemm.ENV_VAR, raising=False)
    assert not strip_gemm_available(torch.bfloat16)
    assert strip_gemm_available(torch.float32) == fp32_path
    assert gemm.gemm_backend("cpu", torch.bfloat16) == gemm.ONEDNN
    assert gemm.gemm_backend("cpu", torch.float32) == (gemm.STRIPS if fp32_path else gemm.ONEDNN)
    with pytest.raises(RuntimeError, match="SHOAL_GEMM=strips"):
        monkeypatch.setenv(gemm.ENV_VAR, gemm.STRIPS)
        gemm.gemm_backend("cpu", torch.bfloat16)
    assert not code_strips_available(32, 64) and not strip_gemm.code_strips_round_x()
    if fp32_path:
        weight, x = torch.randn(50, 40), torch.randn(9, 40)
        _check(strip_linear(x, pack_strips(weight)), x, weight, None)
    assert len(list(fresh_build.glob(f"{strip_gemm.LIBRARY}-*.so"))) == 1


def test_a_build_without_matrix_units_keeps_bf16_on_the_vector_path(fresh_build, monkeypatch):
    """SHOAL_KERNEL_ARCH=cooperlake: AVX512-BF16 (and VNNI) without AMX; the bf16 path still
    answers."""
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("the CPU has no AVX512-BF16")
    monkeypatch.setenv("SHOAL_KERNEL_ARCH", "cooperlake")
    assert strip_gemm_available(torch.bfloat16) and strip_gemm.code_strips_round_x()
    assert not use_matrix_units(True)
    weight, x = torch.randn(40, 64).bfloat16(), torch.randn(20, 64).bfloat16()
    _check(strip_linear(x, pack_strips(weight)), x, weight, None)
    assert matrix_unit_products() == 0


def _int4_case(out_features: int, in_features: int, group: int, seed: int):  # type: ignore[no-untyped-def]
    """Codes, fp16-exact scales and minimums (as GGUF stores them), and the weight they mean."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    groups = (out_features, in_features // group)
    scales = (torch.rand(groups, generator=gen) * 0.2).half().float()
    mins = (torch.randn(groups, generator=gen) * 0.5).half().float()
    grouped = codes.float().view(out_features, -1, group)
    weight = (grouped * scales[..., None] + mins[..., None]).view(out_features, in_features)
    return codes, scales, mins, weight


def _codes_product(x, packed, bias, weight):  # type: ignore[no-untyped-def]
    """The product of codes, and the weight it multiplied by: the codes' own, or that weight
    rounded to bf16 where the product decoded its codes onto the matrix units."""
    before = decoded_code_products()
    out = strip_codes_linear(x, packed, bias)
    decoded = decoded_code_products() > before
    return out, weight.bfloat16().float() if decoded else weight


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 9, 64, 70])
@pytest.mark.parametrize(
    ("out_features", "in_features", "group"), [(16, 32, 32), (50, 64, 32), (96, 256, 64)]
)
def test_4bit_codes_match_their_dequantized_weight(rows, out_features, in_features, group):
    """Rows across the 4-row tiles (one and two rows split each quad's dots) and the 64-row
    blocks; one strip, an odd last strip, paired strips; groups of 32 and 64."""
    if not code_strips_available(group, in_features):
        pytest.skip("the 4-bit strip kernel has no path on this CPU")
    codes, scales, mins, weight = _int4_case(out_features, in_features, group, rows)
    packed = pack_int4_strips(codes, scales, mins, group)
    assert packed.shape == (out_features, in_features) and packed.bits == 4
    padded = -(-out_features // 16) * 16  # whole strips
    assert packed.nbytes == padded * in_features * (0.5 + 4 / group)  # codes + fp16 pairs
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    for b in (None, bias):
        out, multiplied = _codes_product(x, packed, b, weight)
        _check(out, x, multiplied, b)


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_at_many_rows_decode_onto_the_matrix_units(bits):
    """From 8 rows, where the matrix units are on, a product of codes decodes its weight into
    bf16 strips (the weight a bf16 checkpoint would hold) and multiplies there: counted, and
    within one rounding of that weight's product; fewer rows, or the units off, keep the codes'
    own path and their exact weight."""
    if not code_strips_available(32, 96):
        pytest.skip("the strip kernel has no bf16 path on this CPU")
    if not use_matrix_units(True):
        pytest.skip("no matrix units here")
    if bits == 4:
        codes, scales, mins, weight = _int4_case(50, 96, 32, 5)
        packed = pack_int4_strips(codes, scales, mins, 32)
    else:
        codes = torch.randint(-127, 128, (50, 96), generator=torch.Generator().manual_seed(5))
        scales = (torch.rand(50, 3) * 0.01).half().float()
        weight = (codes.float().view(50, 3, 32) * scales[..., None]).flatten(1)
        packed = pack_int8_strips(codes.to(torch.int8), scales, 32)
    x = torch.randn(64, 96).bfloat16()
    rounded = weight.bfloat16().float()
    assert not torch.equal(rounded, weight)  # the two references differ
    try:
        before = decoded_code_products()
        _check(strip_codes_linear(x, packed), x, rounded, None)
        assert decoded_code_products() == before + 1
        _check(strip_codes_linear(x[:4], packed), x[:4], weight, None)
        assert decoded_code_products() == before + 1
        use_matrix_units(False)
        _check(strip_codes_linear(x, packed), x, weight, None)
        assert decoded_code_products() == before + 1
    finally:
        use_matrix_units(True)


def test_4bit_codes_take_strided_and_fp32_inputs():
    if not code_strips_available(32, 64):
        pytest.skip("the 4-bit strip kernel has no path on this CPU")
    codes, scales, mins, weight = _int4_case(40, 64, 32, 3)
    packed = pack_int4_strips(codes, scales, mins, 32)
    wide = torch.randn(6, 128).bfloat16()
    rows = wide[:, 16:80]
    _check(strip_codes_linear(rows, packed), rows, weight, None)
    x32 = torch.randn(2, 3, 64)
    out = strip_codes_linear(x32, packed)  # multiplied in bf16, answered in the input's dtype
    assert out.shape == (2, 3, 40) and out.dtype == torch.float32
    as_bf16 = x32.bfloat16().reshape(6, 64)
    _check(out.reshape(6, 40).bfloat16(), as_bf16, weight, None)


def _rounded_to_8_bits(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the q8 path takes it: each group's values times 127 / max |value| (fp32, the
    quotient correctly rounded: torch's own fp32 division can land a product one ulp off a tie),
    rounded to the nearest integer (ties to even), times max / 127 (fp64)."""
    grouped = x.float().view(len(x), x.shape[1] // group, group)
    largest = grouped.abs().amax(-1, keepdim=True)
    quotient = (127 / largest.double()).float()
    inverse = torch.where(largest > 0, quotient, torch.zeros_like(largest))
    codes = torch.round(grouped * inverse)
    return (codes.double() * (largest.double() / 127)).view(x.shape)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 9, 64, 70])
@pytest.mark.parametrize(
    ("out_features", "in_features", "group"), [(16, 32, 32), (50, 64, 32), (96, 256, 64)]
)
def test_4bit_codes_with_x_rounded_to_8_bits(rows, out_features, in_features, group):
    """The q8 path: each group's dot in integers with x rounded to 8 bits (scale * code parts),
    plus min * the sum of the unrounded x; across row tiles, strips and groups."""
    if not (code_strips_available(group, in_features) and strip_gemm.code_strips_round_x()):
        pytest.skip("the 4-bit strip kernel cannot round x to 8 bits on this CPU")
    codes, scales, mins, weight = _int4_case(out_features, in_features, group, rows)
    packed = pack_int4_strips(codes, scales, mins, group, round_x=True)
    assert packed.rounds_x and packed.nbytes == pack_int4_strips(codes, scales, mins, group).nbytes
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    x[:, :group] = 0  # a group of zeros: scale 0, no division by it
    bias = torch.randn(out_features, generator=gen).bfloat16()
    rounded = _rounded_to_8_bits(x, group)
    code_part = weight.double() - mins.double().repeat_interleave(group, dim=1)
    x_sums = x.double().view(rows, in_features // group, group).sum(-1)
    expected = rounded @ code_part.T + x_sums @ mins.double().T
    scale = float(x.double().abs().sum(-1).max(-1).values.clamp(min=1) if rows else 1.0)
    scale *= float(weight.double().abs().amax())
    for b in (None, bias):
        out = strip_codes_linear(x, packed, b)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        want = expected if b is None else expected + b.double()
        torch.testing.assert_close(out.double(), want, atol=1e-5 * scale, rtol=2**-8)


def test_rounding_x_is_refused_where_the_cpu_cannot(monkeypatch):
    monkeypatch.setattr(strip_gemm, "code_strips_round_x", lambda: False)
    codes, scales, mins, _ = _int4_case(16, 32, 32, 0)
    with pytest.raises(ValueError, match="AVX512-VNNI"):
        pack_int4_strips(codes, scales, mins, 32, round_x=True)


@pytest.mark.parametrize("rows", [0, 1, 2, 4, 5, 64, 70])
@pytest.mark.parametrize(("out_features", "in_features", "group"), [(16, 32, 32), (50, 96, 32)])
def test_8bit_codes_match_their_dequantized_weight(rows, out_features, in_features, group):
    if not code_strips_available(group, in_features):
        pytest.skip("the strip kernel has no bf16 path on this CPU")
    gen = torch.Generator().manual_seed(rows)
    codes = torch.randint(-127, 128, (out_features, in_features), generator=gen).to(torch.int8)
    scales = (torch.rand(out_features, in_features // group, generator=gen) * 0.01).half().float()
    weight = (codes.float().view(out_features, -1, group) * scales[..., None]).flatten(1)
    packed = pack_int8_strips(codes, scales, group)
    assert packed.bits == 8 and packed.shape == (out_features, in_features)
    padded = -(-out_features // 16) * 16
    assert packed.nbytes == padded * in_features * (1 + 2 / group)  # codes + fp16 scales
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    for b in (None, bias):
        out, multiplied = _codes_product(x, packed, b, weight)
        _check(out, x, multiplied, b)
