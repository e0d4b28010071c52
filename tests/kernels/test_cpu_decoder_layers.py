"""A decode step's dense layers in one C call (``kernels/cpu/decoder_layers.c``): bit for bit
the layer-by-layer kernel calls (outputs, residual stream and every layer's cache), on the
matrix units and off them, in fp32 and bf16; the layers it refuses; its errors."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import cpu_build, cpu_decoder_layers, gemm, ops, strip_gemm
from shoal.kernels.cpu_decoder_layers import DecoderLayerParts
from shoal.kernels.rotary import build_cos_sin_cache
from tests.kernels.paged_case import make_paged_case

needs_kernel = pytest.mark.skipif(
    cpu_build.load_kernel_library(cpu_decoder_layers.LIBRARY) is None
    or not strip_gemm.strip_gemm_available(torch.bfloat16),
    reason="no C compiler or no wide strip products here",
)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 128, 6, 2, 64, 96, 3
EPS = 1e-5
GROUP = 32  # inputs per code scale


def _packed(rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator, bits: int = 0):  # type: ignore[no-untyped-def]
    """Packed floats (bits 0), or 4- or 8-bit codes in strips with fp16 scales (and minimums)."""
    if bits == 0:
        return strip_gemm.pack_strips((torch.randn(rows, cols, generator=gen) * 0.1).to(dtype))
    groups = cols // GROUP
    scales = (torch.rand(rows, groups, generator=gen) * 0.02).half()
    if bits == 8:
        codes = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8)
        return strip_gemm.pack_int8_strips(codes, scales, GROUP)
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    mins = (-torch.rand(rows, groups, generator=gen) * 0.1).half()
    return strip_gemm.pack_int4_strips(codes, scales, mins, GROUP)


def _layers(dtype: torch.dtype, caches, bits=(0, 0, 0, 0)) -> list[DecoderLayerParts]:  # type: ignore[no-untyped-def]
    """Random layers; ``bits`` picks each product's weights (q/k/v, o, gate/up, down)."""
    gen = torch.Generator().manual_seed(1)
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv, o_proj, gate_up, down = bits
    return [
        DecoderLayerParts(
            input_norm=(1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype),
            qkv=_packed(qkv_width, HIDDEN, dtype, gen, qkv),
            o_proj=_packed(HIDDEN, HEADS * HEAD_DIM, dtype, gen, o_proj),
            post_norm=(1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype),
            gate_up=_packed(2 * INTER, HIDDEN, dtype, gen, gate_up),
            down=_packed(HIDDEN, INTER, dtype, gen, down),
            k_cache=k_cache,
            v_cache=v_cache,
        )
        for k_cache, v_cache in caches
    ]


def _step_case(dtype: torch.dtype, many: bool):  # type: ignore[no-untyped-def]
    """Each layer's caches, the embedding's rows, the step's plan on a q/k/v scratch."""
    lens = [1, 37, 200, 15, 650]
    lens = lens * torch.get_num_threads() * 2 if many else lens
    case = make_paged_case(
        [1] * len(lens), lens, num_kv_heads=KV_HEADS, gqa=HEADS // KV_HEADS, head_dim=HEAD_DIM,
        block_size=16, dtype=dtype,
    )  # fmt: skip
    caches = [(case.k_cache * (1 + layer), case.v_cache - layer) for layer in range(LAYERS)]
    positions = case.seq_lens.long() - 1
    pages = case.block_tables.long().gather(1, (positions // 16)[:, None])[:, 0]
    slots = pages * 16 + positions % 16
    qkv = torch.empty(len(lens), (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
    plan = ops.plan_paged_attention(
        qkv.view(len(lens), -1, HEAD_DIM)[:, :HEADS], case.k_cache, case.block_tables,
        case.query_start_loc, case.seq_lens,
    )  # fmt: skip
    cos_sin = build_cos_sin_cache(HEAD_DIM, 4096, 10000.0)
    step = ops.plan_decode_step(qkv, positions, slots, cos_sin, case.k_cache, HEADS, plan)
    assert step is not None
    x = torch.randn(len(lens), HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    return caches, x, qkv, step, case.scale


def _layer_by_layer(x, parts, step, scale):  # type: ignore[no-untyped-def]
    """What the model's layers answer through their own kernel calls."""
    residual = None
    for p in parts:
        if residual is None:
            residual, h = x, ops.rms_norm(x, p.input_norm, EPS)
        else:
            h, residual = ops.rms_norm(x, p.input_norm, EPS, residual)
        attn = ops.decode_step(gemm.linear(h, p.qkv), p.k_cache, p.v_cache, step, scale)
        h, residual = ops.rms_norm(gemm.linear(attn, p.o_proj), p.post_norm, EPS, residual)
        x = gemm.linear(gemm.gated_linear(h, p.gate_up), p.down)
    return x, residual


@pytest.fixture(params=[True, False], ids=["matrix-units", "vector-units"])
def matrix_units(request):  # type: ignore[no-untyped-def]
    on = strip_gemm.use_matrix_units(request.param)
    if request.param and not on:
        pytest.skip("no matrix units here")
    yield on
    strip_gemm.use_matrix_units(True)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])
def test_the_layers_in_one_call_are_their_own_calls_bit_for_bit(dtype, many, matrix_units):
    caches, x, qkv, step, scale = _step_case(dtype, many)
    ours = _layers(dtype, [(k.clone(), v.clone()) for k, v in caches])
    theirs = _layers(dtype, [(k.clone(), v.clone()) for k, v in caches])
    want_x, want_residual = _layer_by_layer(x.clone(), theirs, step, scale)
    table = ops.plan_decoder_layers(ours, EPS)
    assert table is not None
    calls = cpu_decoder_layers.decoder_layer_calls()
    products = strip_gemm.matrix_unit_products()
    got_x, got_residual = ops.decoder_layers(x.clone(), table, step, qkv, scale)
    assert cpu_decoder_layers.decoder_layer_calls() == calls + 1
    on_matrix_units = matrix_units and dtype == torch.bfloat16  # 3 products + the gated one
    assert strip_gemm.matrix_unit_products() - products == (4 * LAYERS if on_matrix_units else 0)
    assert torch.equal(got_x, want_x) and torch.equal(got_residual, want_residual)
    for mine, reference in zip(ours, theirs, strict=True):
        assert torch.equal(mine.k_cache, reference.k_cache)
        assert torch.equal(mine.v_cache, reference.v_cache)


@needs_kernel
@pytest.mark.parametrize(
    "bits", [(4, 4, 4, 4), (8, 8, 8, 8), (4, 0, 8, 4)], ids=["int4", "int8", "mixed"]
)
@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])
def test_layers_of_code_strips_in_one_call_are_their_own_calls_bit_for_bit(bits, many):
    """4- and 8-bit codes (bf16; their gate/up product then silu-and-mul, as the layers' own
    calls make them), alone or beside packed floats."""
    caches, x, qkv, step, scale = _step_case(torch.bfloat16, many)
    ours = _layers(torch.bfloat16, [(k.clone(), v.clone()) for k, v in caches], bits)
    theirs = _layers(torch.bfloat16, [(k.clone(), v.clone()) for k, v in caches], bits)
    assert isinstance(ours[0].qkv, strip_gemm.StripCodesWeight)
    want_x, want_residual = _layer_by_layer(x.clone(), theirs, step, scale)
    table = ops.plan_decoder_layers(ours, EPS)
    assert table is not None
    got_x, got_residual = ops.decoder_layers(x.clone(), table, step, qkv, scale)
    assert torch.equal(got_x, want_x) and torch.equal(got_residual, want_residual)
    for mine, reference in zip(ours, theirs, strict=True):
        assert torch.equal(mine.k_cache, reference.k_cache)


@needs_kernel
def test_layers_of_another_dtype_or_shape_are_not_taken_in_one_call():
    caches, *_ = _step_case(torch.bfloat16, False)
    parts = _layers(torch.bfloat16, caches)
    assert ops.plan_decoder_layers(parts, EPS) is not None
    fp32_norm = DecoderLayerParts(**{**vars(parts[1]), "post_norm": parts[1].post_norm.float()})
    assert ops.plan_decoder_layers([parts[0], fp32_norm, parts[2]], EPS) is None
    gen = torch.Generator().manual_seed(3)
    wider = DecoderLayerParts(
        **{
            **vars(parts[2]),
            "gate_up": _packed(4 * INTER, HIDDEN, torch.bfloat16, gen),
            "down": _packed(HIDDEN, 2 * INTER, torch.bfloat16, gen),
        }
    )
    assert ops.plan_decoder_layers([parts[0], parts[1], wider], EPS) is None
    assert ops.plan_decoder_layers([], EPS) is None
    fp32_caches, *_ = _step_case(torch.float32, False)  # codes multiply in bf16 only
    assert ops.plan_decoder_layers(_layers(torch.float32, fp32_caches, (4, 4, 4, 4)), EPS) is None


@needs_kernel
def test_a_position_outside_the_rotary_cache_raises_and_leaves_the_rows():
    caches, x, qkv, step, scale = _step_case(torch.float32, False)
    table = ops.plan_decoder_layers(_layers(torch.float32, caches), EPS)
    positions = step.tensors[0]
    positions[0] = 5000
    rows = x.clone()
    with pytest.raises(IndexError, match="rotary positions"):
        ops.decoder_layers(rows, table, step, qkv, scale)
    assert torch.equal(rows, x)
