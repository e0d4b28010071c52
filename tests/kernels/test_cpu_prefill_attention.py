"""shoal's prefill attention on the CPU's matrix units (``kernels/cpu/prefill_attention.c``):
prompt runs against the naive attention, counted where they run, its place in the torch path's
plan (runs of more than 8 queries, unless the decode kernel can take the whole step; shorter
ones stay there), and where it does not run: shapes and dtypes it does not take, a build for a
CPU without AMX, the kernel declining."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import cpu_build, cpu_prefill_attention, varlen_attention
from shoal.kernels.cpu_decode_attention import CpuDecodePlan
from shoal.kernels.varlen_attention import plan_varlen_torch, varlen_attention_torch
from tests.kernels.paged_case import make_paged_case, naive_attention

BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}
PROBE = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16)
needs_amx = pytest.mark.skipif(
    not cpu_prefill_attention.cpu_prefill_available(PROBE, 1),
    reason="no AMX-BF16 here (or no C compiler): the prompts go to SDPA",
)
# Decodes, drafts and short runs (<= 8: the decode kernel), runs of 9-64 queries, runs past a
# work item's 64 queries, runs after a cached prefix, contexts past one 512-key block.
QUERY_LENS = [1, 8, 9, 17, 64, 65, 130, 700, 3]
CONTEXT_LENS = [30, 0, 0, 5, 0, 40, 600, 300, 77]
RUNS = [2, 3, 4, 5, 6, 7]  # the sequences with more than 8 queries


def _attend(case):  # type: ignore[no-untyped-def]
    plan = plan_varlen_torch(
        case.block_tables, case.query_start_loc, case.seq_lens, case.k_cache, case.q.shape[1]
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc)
    return plan, varlen_attention_torch(*args, case.seq_lens, case.scale, plan)


@needs_amx
@pytest.mark.parametrize(
    ("gqa", "head_dim", "block_size"),
    # SmolLM2's 3 x 64; one query head per kv head; pages shorter than a key tile; the largest
    # group and head size the kernel takes; pages of 128 keys
    [(3, 64, 16), (1, 32, 4), (16, 64, 16), (2, 256, 8), (4, 128, 128)],
)
def test_prompt_runs_match_the_naive_attention_in_one_call(gqa, head_dim, block_size):
    case = make_paged_case(
        QUERY_LENS, CONTEXT_LENS, num_kv_heads=2, gqa=gqa, head_dim=head_dim,
        block_size=block_size, dtype=torch.bfloat16,
    )  # fmt: skip
    before = cpu_prefill_attention.prefill_attention_calls()
    plan, out = _attend(case)
    assert cpu_prefill_attention.prefill_attention_calls() == before + 1
    assert plan.prefill is not None and plan.reads is None and plan.seqs == RUNS
    assert plan.prefill.query_lens.tolist() == [QUERY_LENS[s] for s in RUNS]
    assert isinstance(plan.decode, CpuDecodePlan)
    assert len(plan.decode.token_rows) == 1 + 8 + 3  # the decode, the run of 8, the drafts
    torch.testing.assert_close(out, naive_attention(case), **BF16_TOL)


@needs_amx
@pytest.mark.parametrize(
    ("query_lens", "to_prefill"),
    [
        ([1, 40, 64, 64, 64, 24, 3], []),  # 256 queries in runs past 8: one call's step
        ([1, 40, 64, 64, 64, 25, 3], [1, 2, 3, 4, 5]),  # 257
        ([1, 65, 3], [1]),  # a run past 64
    ],
    ids=["fits", "one-query-more", "a-long-run"],
)
def test_a_step_the_decode_kernel_can_take_whole_stays_there(query_lens, to_prefill):
    """Short prompts only (none past 64 queries, at most 256 in the runs past 8): the decode
    kernel takes every query in batch order (the step then runs each layer's rotary, KV write
    and attention as one C call, or all its layers as one); past either bound, the runs past 8
    go to the prefill kernel."""
    case = make_paged_case(
        query_lens, [10] + [0] * (len(query_lens) - 2) + [7], num_kv_heads=3, gqa=3,
        head_dim=64, block_size=16, dtype=torch.bfloat16,
    )  # fmt: skip
    plan, out = _attend(case)
    assert isinstance(plan.decode, CpuDecodePlan)
    assert plan.seqs == to_prefill and (plan.prefill is None) == (not to_prefill)
    assert plan.decode.in_order == (not to_prefill)
    torch.testing.assert_close(out, naive_attention(case), **BF16_TOL)


@needs_amx
def test_every_query_row_is_written_and_only_the_runs_rows():
    """The kernel writes the runs' rows of ``out`` and nothing else (rows of other sequences
    keep what they had)."""
    case = make_paged_case(
        [20, 1, 33], [0, 12, 100], num_kv_heads=3, gqa=3, head_dim=64, block_size=16,
        dtype=torch.bfloat16,
    )  # fmt: skip
    seqs = torch.tensor([0, 2])
    plan = cpu_prefill_attention.plan_cpu_prefill(
        case.block_tables, case.query_start_loc, case.seq_lens, seqs
    )
    out = torch.full_like(case.q, float("nan"))
    args = (case.q, case.k_cache, case.v_cache, plan, case.scale, out)
    assert cpu_prefill_attention.cpu_prefill_attention(*args)
    reference = naive_attention(case)
    assert out[20].isnan().all()  # the decode's row
    rows = torch.cat((torch.arange(20), torch.arange(21, 54)))
    torch.testing.assert_close(out[rows], reference[rows], **BF16_TOL)


@needs_amx
def test_queries_read_from_a_fused_projection_s_rows():
    """q as the attention layer gets it: a view of the fused q/k/v rows (tokens further apart
    than their heads)."""
    case = make_paged_case(
        [40, 70], [0, 10], num_kv_heads=3, gqa=3, head_dim=64, block_size=16,
        dtype=torch.bfloat16,
    )  # fmt: skip
    tokens = case.q.shape[0]
    fused = torch.zeros(tokens, (9 + 6) * 64, dtype=torch.bfloat16)
    fused[:, : 9 * 64] = case.q.reshape(tokens, -1)
    case.q = fused[:, : 9 * 64].view(tokens, 9, 64)
    assert case.q.stride(0) == 15 * 64
    plan, out = _attend(case)
    assert plan.prefill is not None
    torch.testing.assert_close(out, naive_attention(case), **BF16_TOL)


@needs_amx
def test_the_kernel_declines_what_it_does_not_take_and_sdpa_answers(monkeypatch):
    """Queries not in bf16 or caches not contiguous: the kernel declines (False, nothing
    counted); a declined call (buffers it could not allocate) sends the runs to SDPA."""
    case = make_paged_case(
        [1, 40, 100], [9, 0, 20], num_kv_heads=2, gqa=3, head_dim=64, block_size=16,
        dtype=torch.bfloat16,
    )  # fmt: skip
    plan, _ = _attend(case)
    assert plan.prefill is not None
    before = cpu_prefill_attention.prefill_attention_calls()
    run = cpu_prefill_attention.cpu_prefill_attention
    strided = case.k_cache[:, ::2]
    assert not run(case.q.float(), case.k_cache, case.v_cache, plan.prefill, 0.1, case.q.float())
    assert not run(case.q, strided, strided, plan.prefill, 0.1, torch.empty_like(case.q))
    assert cpu_prefill_attention.prefill_attention_calls() == before
    monkeypatch.setattr(varlen_attention, "cpu_prefill_attention", lambda *args: False)
    plan, out = _attend(case)
    assert plan.prefill is not None
    torch.testing.assert_close(out, naive_attention(case), **BF16_TOL)


@pytest.mark.parametrize(
    ("dtype", "gqa", "head_dim"),
    [(torch.float32, 3, 64), (torch.bfloat16, 3, 48), (torch.bfloat16, 17, 64)],
    ids=["fp32", "head-48", "group-17"],
)
def test_dtypes_and_shapes_it_does_not_take_go_to_sdpa(dtype, gqa, head_dim):
    """(300 queries: past what the decode kernel takes in fp32.)"""
    case = make_paged_case(
        [1, 300], [9, 0], num_kv_heads=1, gqa=gqa, head_dim=head_dim, block_size=16,
        dtype=dtype,
    )  # fmt: skip
    plan, out = _attend(case)
    assert plan.prefill is None and plan.reads is not None and plan.seqs == [1]
    tol = BF16_TOL if dtype == torch.bfloat16 else {"atol": 2e-5, "rtol": 1e-5}
    torch.testing.assert_close(out, naive_attention(case), **tol)


def test_built_for_a_cpu_without_matrix_units_the_runs_go_to_sdpa(fresh_build, monkeypatch):
    """SHOAL_KERNEL_ARCH=x86-64-v3 (AVX2): the library builds without the AMX path, answers
    that it is not ready, and the prompts run as SDPAs."""
    monkeypatch.setenv("SHOAL_KERNEL_ARCH", "x86-64-v3")
    lib = cpu_build.load_kernel_library(
        cpu_prefill_attention.LIBRARY, cpu_prefill_attention._SIGNATURES
    )
    if lib is None:
        pytest.skip("no C compiler here")
    assert lib.prefill_attention_ready() == 0
    case = make_paged_case(
        [1, 100], [9, 0], num_kv_heads=1, gqa=3, head_dim=64, block_size=16,
        dtype=torch.bfloat16,
    )  # fmt: skip
    plan, out = _attend(case)
    assert plan.prefill is None and plan.reads is not None
    torch.testing.assert_close(out, naive_attention(case), **BF16_TOL)
