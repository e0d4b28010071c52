"""shoal's C decode kernel on the CPU (``kernels/cpu/paged_decode_attention.c``): against the
decode reference and the naive attention, its context splits, its place in the torch path's plan,
and the build: cached per machine, and the torch paths when it cannot be built."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import (
    cpu_build,
    cpu_decode_attention,
    cpu_decode_step,
    cpu_pointwise,
    ops,
    varlen_attention,
)
from shoal.kernels.cpu_decode_attention import CpuDecodePlan
from shoal.kernels.decode_attention import decode_attention_torch
from shoal.kernels.rotary import build_cos_sin_cache
from shoal.kernels.sparse_decode import DecodePattern
from shoal.kernels.varlen_attention import plan_varlen_torch, varlen_attention_torch
from shoal.workers.cpu_info import cpu_flags
from tests.kernels.paged_case import make_paged_case, naive_attention

needs_kernel = pytest.mark.skipif(
    cpu_build.load_kernel_library(cpu_decode_attention.LIBRARY) is None,
    reason="no C compiler here: the kernel cannot be built",
)
FP32_TOL = {"atol": 2e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}


def _attend(case):  # type: ignore[no-untyped-def]
    plan = plan_varlen_torch(
        case.block_tables, case.query_start_loc, case.seq_lens, case.k_cache, case.q.shape[1]
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc)
    return plan, varlen_attention_torch(*args, case.seq_lens, case.scale, plan)


def _decode_reference(case):  # type: ignore[no-untyped-def]
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    return decode_attention_torch(*args)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("gqa", "head_dim", "block_size"),
    # 34 query heads (17 x 2) exceed an item's buffers: an item per kv head even when many;
    # a head size of 48 is not whole 32-wide vectors: the scalar scores and softmax
    [(1, 64, 16), (3, 64, 4), (4, 128, 128), (8, 32, 16), (17, 64, 16), (2, 48, 16)],
)
@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])
def test_decodes_match_the_decode_reference(dtype, gqa, head_dim, block_size, many):
    """Few decodes: an item per (sequence, kv head, piece); many: per (sequence, piece), all of
    its kv heads in one item."""
    lens = [0, 1, 37, 200, 15, 650]
    threads = torch.get_num_threads()
    lens = lens * threads * 2 if many else lens[:3]  # 12 per thread, or under 4 in all
    case = make_paged_case(
        [1] * len(lens), lens, num_kv_heads=2, gqa=gqa, head_dim=head_dim,
        block_size=block_size, dtype=dtype,
    )  # fmt: skip
    plan, out = _attend(case)
    assert isinstance(plan.decode, CpuDecodePlan)
    assert plan.decode.kv_per_item == (2 if many and gqa * 2 <= 32 else 1)
    assert out.dtype == dtype
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out, _decode_reference(case), **tol)


def _bf16_decodes(lens, gqa, head_dim, block_size):  # type: ignore[no-untyped-def]
    """A bf16 case of one decode per context length (2 kv heads), NaN in the slots of each
    sequence's last page past its length: rows a 16-key tile loads whole on the matrix units,
    which must weigh nothing."""
    case = make_paged_case(
        [1] * len(lens), lens, num_kv_heads=2, gqa=gqa, head_dim=head_dim,
        block_size=block_size, dtype=torch.bfloat16,
    )  # fmt: skip
    for s, n in enumerate(case.seq_lens.tolist()):
        if n % block_size:
            page = int(case.block_tables[s, n // block_size])
            case.k_cache[page, n % block_size :] = float("nan")
            case.v_cache[page, n % block_size :] = float("nan")
    return case


@pytest.fixture
def vector_path():  # type: ignore[no-untyped-def]
    """A callable that runs its argument with bf16 decodes kept off the matrix units."""

    def run(fn, *args):  # type: ignore[no-untyped-def]
        cpu_decode_attention.use_decode_matrix_units(False)
        try:
            return fn(*args)
        finally:
            cpu_decode_attention.use_decode_matrix_units(True)

    return run


@needs_kernel
@pytest.mark.parametrize(
    ("gqa", "head_dim", "block_size"), [(1, 64, 16), (3, 64, 16), (4, 128, 128), (8, 32, 32)]
)
@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])
def test_bf16_decodes_on_the_matrix_units_match_the_reference_and_the_vector_path(
    gqa, head_dim, block_size, many, vector_path
):
    """Where the CPU has AMX, bf16 decodes score 16-key tiles on the matrix units (counted per
    call) and weigh values by bf16 pairs: the same answer as the dense reference and, within
    the weights' bf16 rounding, the vector path's. Contexts end inside tiles, on a tile's edge
    and past it, and few long ones are split in pieces of whole tiles."""
    if not cpu_decode_attention.decode_matrix_units_ready():
        pytest.skip("no matrix units (AMX) here, or the OS does not grant them")
    lens = [0, 1, 15, 16, 17, 200, 650]
    lens = lens * torch.get_num_threads() * 2 if many else [650]
    case = _bf16_decodes(lens, gqa, head_dim, block_size)
    before = cpu_decode_attention.decode_matrix_calls()
    plan, out = _attend(case)
    assert isinstance(plan.decode, CpuDecodePlan)
    assert plan.decode.splits > 1 or many
    assert cpu_decode_attention.decode_matrix_calls() == before + 1
    torch.testing.assert_close(out, naive_attention(case).to(out.dtype), **BF16_TOL)
    _, vector = vector_path(_attend, case)
    assert cpu_decode_attention.decode_matrix_calls() == before + 1
    torch.testing.assert_close(out, vector, atol=1e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize(
    ("gqa", "head_dim", "block_size"),
    # pages of 8 keys (a tile would span two), a group of 17 (past a tile's 16 columns), a head
    # size of 48 (not whole 32-feature steps)
    [(3, 64, 8), (17, 64, 16), (2, 48, 16)],
)
def test_bf16_shapes_the_matrix_units_do_not_take_run_on_the_vector_path(gqa, head_dim, block_size):
    lens = [0, 1, 15, 200, 650] * torch.get_num_threads() * 2
    case = _bf16_decodes(lens, gqa, head_dim, block_size)
    before = cpu_decode_attention.decode_matrix_calls()
    _, out = _attend(case)
    assert cpu_decode_attention.decode_matrix_calls() == before
    torch.testing.assert_close(out, naive_attention(case).to(out.dtype), **BF16_TOL)


@needs_kernel
@pytest.mark.parametrize("block_size", [4, 16])
def test_bf16_decodes_on_the_vector_path_match_the_reference(block_size, vector_path):
    """The path of CPUs with AVX512-BF16 but no matrix units, on this one."""
    lens = [0, 1, 15, 16, 17, 200, 650] * torch.get_num_threads() * 2
    case = _bf16_decodes(lens, 3, 64, block_size)
    before = cpu_decode_attention.decode_matrix_calls()
    _, out = vector_path(_attend, case)
    assert cpu_decode_attention.decode_matrix_calls() == before
    torch.testing.assert_close(out, naive_attention(case).to(out.dtype), **BF16_TOL)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_context_split_in_pieces_merges_to_the_same_answer(dtype, monkeypatch):
    """One long decode: its context is cut into pieces attended apart and merged."""
    monkeypatch.setattr(cpu_decode_attention, "MIN_SPLIT_KEYS", 16)
    monkeypatch.setattr(cpu_decode_attention, "ITEMS_PER_THREAD", 64)
    case = make_paged_case(
        [1, 1], [900, 40], num_kv_heads=1, gqa=4, head_dim=64, block_size=16, dtype=dtype
    )
    plan, out = _attend(case)
    assert isinstance(plan.decode, CpuDecodePlan) and plan.decode.splits > 4
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out, _decode_reference(case), **tol)


@needs_kernel
def test_a_mixed_batch_sends_decodes_and_short_runs_to_the_kernel_and_chunks_to_sdpa():
    case = make_paged_case(
        [5, 1, 260, 1, 300, 1], [0, 30, 12, 3, 40, 300], num_kv_heads=2, gqa=2, head_dim=64,
        block_size=16,
    )  # fmt: skip
    plan, out = _attend(case)
    assert isinstance(plan.decode, CpuDecodePlan)
    assert plan.decode.token_rows.tolist() == [0, 1, 2, 3, 4, 5, 266, 567]
    assert not plan.decode.in_order  # gathered from the batch, scattered back
    assert plan.decode.seq_lens.tolist() == [1, 2, 3, 4, 5, 31, 4, 301]  # keys each one sees
    assert plan.seqs == [2, 4]  # runs of more than MAX_KERNEL_QUERY_LEN queries
    torch.testing.assert_close(out, naive_attention(case), **FP32_TOL)


@needs_kernel
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_where_torch_has_amx_bf16_prompts_of_more_than_64_tokens_go_to_sdpa(
    monkeypatch, amx, dtype
):
    """Without shoal's AMX prefill kernel (tests/kernels/test_cpu_prefill_attention.py), an
    80-token prompt: SDPA in bf16 where torch multiplies on the matrix units, the kernel
    otherwise (fp32 anywhere, bf16 without AMX); runs of 64 and 8 queries stay in the kernel."""
    monkeypatch.setattr(varlen_attention, "_torch_has_amx", lambda: amx)
    monkeypatch.setattr(varlen_attention, "cpu_prefill_available", lambda *args: False)
    case = make_paged_case(
        [1, 80, 8, 64], [20, 0, 30, 0], num_kv_heads=2, gqa=2, head_dim=64, block_size=16,
        dtype=dtype,
    )  # fmt: skip
    plan, out = _attend(case)
    assert plan.seqs == ([1] if amx and dtype == torch.bfloat16 else [])
    assert isinstance(plan.decode, CpuDecodePlan)
    assert len(plan.decode.token_rows) == (73 if plan.seqs else 153)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out, naive_attention(case), **tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_drafts_being_verified_attend_causally_in_the_kernel(dtype):
    """Runs of 2-8 queries at the end of their sequences (speculative decoding's verify step):
    each query sees the keys up to its own position, as SDPA's bottom-right causal mask does."""
    case = make_paged_case(
        [2, 6, 8, 3, 1], [40, 7, 300, 0, 129], num_kv_heads=2, gqa=3, head_dim=64,
        block_size=16, dtype=dtype,
    )  # fmt: skip
    plan, out = _attend(case)
    assert isinstance(plan.decode, CpuDecodePlan) and plan.seqs == []
    assert plan.decode.in_order and plan.decode.token_rows.tolist() == list(range(20))
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out, naive_attention(case), **tol)


@needs_kernel
def test_a_step_of_decodes_only_is_planned_from_the_batch_s_own_table():
    """Every sequence one query (the common step): the plan the general path makes, without
    gathering the table; a sequence with none beside one with two is not such a step."""
    case = make_paged_case(
        [1, 1, 1, 1], [10, 700, 0, 33], num_kv_heads=2, gqa=3, head_dim=64, block_size=16
    )
    plan, out = _attend(case)
    assert isinstance(plan.decode, CpuDecodePlan) and plan.decode.in_order and plan.seqs == []
    assert plan.decode.block_tables.data_ptr() == case.block_tables.data_ptr()  # no gather
    seqs = torch.arange(4)
    general = cpu_decode_attention.plan_cpu_decode(
        case.block_tables, seqs, seqs, case.seq_lens, 6, 2
    )
    assert torch.equal(plan.decode.block_tables, general.block_tables)
    assert torch.equal(plan.decode.seq_lens, general.seq_lens)
    assert (plan.decode.splits, plan.decode.split_keys, plan.decode.kv_per_item) == (
        general.splits,
        general.split_keys,
        general.kv_per_item,
    )
    torch.testing.assert_close(out, _decode_reference(case), **FP32_TOL)
    uneven = make_paged_case([0, 2], [5, 9], num_kv_heads=2, gqa=3, head_dim=64, block_size=16)
    plan, out = _attend(uneven)
    assert isinstance(plan.decode, CpuDecodePlan) and plan.decode.token_rows.tolist() == [0, 1]
    assert plan.decode.seq_lens.tolist() == [10, 11]  # the two queries of the second sequence
    torch.testing.assert_close(out, naive_attention(uneven), **FP32_TOL)


@needs_kernel
def test_rows_past_the_batch_s_queries_leave_the_decodes_in_place():
    """A batch padded past its queries (rows no sequence owns): the decodes, in batch order,
    still read and write their own rows."""
    case = make_paged_case(
        [1, 1, 1], [10, 70, 33], num_kv_heads=2, gqa=2, head_dim=64, block_size=16
    )
    plan = plan_varlen_torch(
        case.block_tables, case.query_start_loc, case.seq_lens, case.k_cache, case.q.shape[1]
    )
    assert isinstance(plan.decode, CpuDecodePlan) and plan.decode.in_order
    padded_q = torch.cat([case.q, torch.randn(2, *case.q.shape[1:])])
    args = (padded_q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc)
    out = varlen_attention_torch(*args, case.seq_lens, case.scale, plan)
    assert out.shape == padded_q.shape
    torch.testing.assert_close(out[:3], _decode_reference(case), **FP32_TOL)


@pytest.mark.parametrize(
    ("dtype", "torch_path"), [(torch.float32, DecodePattern), (torch.bfloat16, type(None))]
)
def test_forcing_the_torch_kernels_keeps_the_torch_decode_paths(dtype, torch_path, monkeypatch):
    monkeypatch.setenv("SHOAL_KERNELS", "torch")
    case = make_paged_case(
        [1] * 4, [0, 33, 7, 64], num_kv_heads=2, gqa=2, head_dim=64, block_size=4, dtype=dtype
    )
    plan, out = _attend(case)
    assert isinstance(plan.decode, torch_path)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out, _decode_reference(case), **tol)


def test_without_a_compiler_the_sparse_products_serve_decodes(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    assert cpu_build.load_kernel_library(cpu_decode_attention.LIBRARY) is None
    case = make_paged_case(
        [1] * 4, [0, 33, 7, 64], num_kv_heads=2, gqa=2, head_dim=64, block_size=4
    )
    plan, out = _attend(case)
    assert isinstance(plan.decode, DecodePattern)
    torch.testing.assert_close(out, _decode_reference(case), **FP32_TOL)


@needs_kernel
@pytest.mark.parametrize(
    ("arch", "flag"),
    [("x86-64-v3", "avx2"), ("skylake-avx512", "avx512f")],
    ids=["avx2", "avx512f"],
)
def test_built_for_an_older_cpu_the_kernel_answers_the_same(fresh_build, monkeypatch, arch, flag):
    """SHOAL_KERNEL_ARCH: the paths of CPUs without AVX-512 (a dot per key and query head, no
    folded tile scores) and of AVX-512 without bf16 dot products (bf16 widened to fp32), built
    and run on this machine, once: loading the library again takes the cached build."""
    if flag not in cpu_flags():
        pytest.skip(f"the CPU has no {flag}")
    monkeypatch.setenv("SHOAL_KERNEL_ARCH", arch)
    for dtype in (torch.float32, torch.bfloat16):
        for gqa, head_dim in ((3, 64), (2, 32)):
            case = make_paged_case(
                [1] * 5, [0, 17, 200, 33, 129], num_kv_heads=2, gqa=gqa, head_dim=head_dim,
                block_size=16, dtype=dtype,
            )  # fmt: skip
            plan, out = _attend(case)
            assert isinstance(plan.decode, CpuDecodePlan)
            tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
            torch.testing.assert_close(out, _decode_reference(case), **tol)
    assert len(list(fresh_build.glob("paged_decode_attention-*.so"))) == 1
    # Built once per machine: a process loading it again takes the build from the cache.
    cpu_build.load_kernel_library.cache_clear()

    def no_build(*args: object) -> None:
        raise AssertionError("built again")

    monkeypatch.setattr(cpu_build, "_compile", no_build)
    assert cpu_build.load_kernel_library(cpu_decode_attention.LIBRARY) is not None


def test_a_changed_shared_header_builds_the_libraries_again(tmp_path, monkeypatch):
    """The build key covers the headers the sources include, not only the source itself."""
    (tmp_path / "k.c").write_text('#include "shared.h"\n')
    (tmp_path / "shared.h").write_text("#define A 1\n")
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", tmp_path)
    before = cpu_build._build_key(tmp_path / "k.c", "cc")
    assert cpu_build._build_key(tmp_path / "k.c", "cc") == before
    (tmp_path / "shared.h").write_text("#define A 2\n")
    assert cpu_build._build_key(tmp_path / "k.c", "cc") != before


def test_shapes_past_the_kernels_buffers_are_not_offered():
    cache = torch.zeros(2, 4, 1, 64)
    assert not cpu_decode_attention.cpu_decode_available(cache, num_q_heads=64)  # group 64
    assert not cpu_decode_attention.cpu_decode_available(torch.zeros(2, 4, 1, 512), 4)
    assert not cpu_decode_attention.cpu_decode_available(cache.half(), 4)


def _decode_step_case(dtype, many):  # type: ignore[no-untyped-def]
    """A step of decodes: the paged case, its new tokens' fused q/k/v rows, positions, slots."""
    lens = [1, 37, 200, 15, 650]
    lens = lens * torch.get_num_threads() * 2 if many else lens
    case = make_paged_case(
        [1] * len(lens), lens, num_kv_heads=2, gqa=3, head_dim=64, block_size=16, dtype=dtype
    )
    qkv = torch.randn(len(lens), (6 + 2 * 2) * 64, dtype=dtype)
    positions = case.seq_lens.long() - 1
    pages = case.block_tables.long().gather(1, (positions // 16)[:, None])[:, 0]
    return case, qkv, positions, pages * 16 + positions % 16


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rotary_dim", "is_neox"), [(64, True), (64, False), (32, True)])
@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])
def test_a_decode_step_in_one_call_is_the_three_calls_bit_for_bit(dtype, rotary_dim, is_neox, many):
    """Rotary, K/V write and attention in one C call (``cpu_decode_step``): the same caches and
    outputs as ``apply_rotary_cpu``, ``write_kv_cpu`` and the decode kernel in turn."""
    case, qkv, positions, slots = _decode_step_case(dtype, many)
    cos_sin = build_cos_sin_cache(rotary_dim, 4096, 10000.0)
    plan, _ = _attend(case)
    tokens = len(positions)
    k_three, v_three = case.k_cache.clone(), case.v_cache.clone()
    q, k, v = qkv.view(tokens, -1, 64).split([6, 2, 2], dim=1)
    rotated = cpu_pointwise.apply_rotary_cpu(q, k, positions, cos_sin, is_neox)
    assert rotated is not None
    assert cpu_pointwise.write_kv_cpu(rotated[1], v, k_three, v_three, slots)
    args = (case.block_tables, case.query_start_loc, case.seq_lens, case.scale, plan)
    want = varlen_attention_torch(rotated[0], k_three, v_three, *args)
    k_one, v_one = case.k_cache.clone(), case.v_cache.clone()
    step = ops.plan_decode_step(qkv, positions, slots, cos_sin, k_one, 6, plan, is_neox=is_neox)
    assert step is not None
    before = cpu_decode_step.fused_decode_calls()
    got = ops.decode_step(qkv, k_one, v_one, step, case.scale)
    assert cpu_decode_step.fused_decode_calls() == before + 1
    assert torch.equal(k_one, k_three) and torch.equal(v_one, v_three)
    assert torch.equal(got, want.reshape(tokens, -1))


@needs_kernel
def test_a_step_with_a_prompt_chunk_or_a_bad_position_is_not_taken_in_one_call():
    """A prompt chunk the decode kernel does not take (SDPA's) in the step: no plan (the three
    calls run); a position outside the cos/sin rows: the same IndexError the rotary call
    raises."""
    case, qkv, positions, slots = _decode_step_case(torch.float32, False)
    cos_sin = build_cos_sin_cache(64, 4096, 10000.0)
    chunked = make_paged_case([1, 260], [20, 0], num_kv_heads=2, gqa=3, head_dim=64, block_size=16)
    chunk_plan, _ = _attend(chunked)
    assert chunk_plan.seqs == [1]
    mixed_qkv = torch.randn(261, 10 * 64)
    mixed = (torch.arange(261), torch.arange(261), cos_sin, chunked.k_cache, 6, chunk_plan)
    assert ops.plan_decode_step(mixed_qkv, *mixed) is None
    plan, _ = _attend(case)
    step = ops.plan_decode_step(qkv, positions + 4096, slots, cos_sin, case.k_cache, 6, plan)
    assert step is not None
    with pytest.raises(IndexError, match="rotary positions"):
        ops.decode_step(qkv, case.k_cache, case.v_cache, step, case.scale)
