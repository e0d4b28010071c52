"""The torch references against plain dense computations (so the references are proven), and the
fast CPU attention paths against them."""

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

from shoal.kernels import ops
from shoal.kernels.decode_attention import decode_attention_torch
from shoal.kernels.fused_moe import fused_moe_torch
from shoal.kernels.varlen_attention import varlen_attention_torch
from tests.kernels.paged_case import make_paged_case, naive_attention

MIXED = ([5, 1, 9, 1, 17], [0, 30, 12, 3, 40])  # query_lens, context_lens (prefill, decode, ...)
DECODE = ([1, 1, 1, 1], [0, 33, 7, 64])
LONG_DECODE = ([1, 1, 1, 1, 1, 0], [100, 20, 70, 5, 47, 9])  # last: no query this step
ALL_DECODE = ([1] * 5, [100, 20, 70, 4, 47])  # one query each: the decode reference's input


def _decode_reference(case):
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    return decode_attention_torch(*args)


@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("shuffle_pages", [True, False], ids=["shuffled", "runs"])
def test_paged_attention_reference_matches_dense(gqa, head_dim, block_size, lens, shuffle_pages):
    case = make_paged_case(
        *lens, num_kv_heads=2, gqa=gqa, head_dim=head_dim, block_size=block_size,
        shuffle_pages=shuffle_pages,
    )  # fmt: skip
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc)
    out = varlen_attention_torch(*args, case.seq_lens, case.scale)
    torch.testing.assert_close(out, naive_attention(case), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("lens", [MIXED, DECODE, LONG_DECODE], ids=["mixed", "decode", "long"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_paged_attention_reference_with_run_and_scattered_tail(
    gqa, block_size, lens, dtype, kernels, monkeypatch
):
    """Decode layout: a consecutive run then a few scattered pages (decodes go through the C
    kernel; forced to torch, fp32 ones through the sparse products, bf16 ones through a view or
    a gather each)."""
    monkeypatch.setenv("SHOAL_KERNELS", kernels)
    case = make_paged_case(
        *lens, num_kv_heads=2, gqa=gqa, head_dim=64, block_size=block_size,
        shuffle_pages=False, tail_pages=3, dtype=dtype,
    )  # fmt: skip
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc)
    out = varlen_attention_torch(*args, case.seq_lens, case.scale)
    tol = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, naive_attention(case), **tol)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_paged_attention_reference_with_peaked_scores_spanning_hundreds(kernels, monkeypatch):
    """Scores far apart (as random models with large weights give): the sparse decode floors
    exponents at -80 to keep weights normal; that must not move the result (nor the C
    kernel's online softmax)."""
    monkeypatch.setenv("SHOAL_KERNELS", kernels)
    case = make_paged_case(*LONG_DECODE, num_kv_heads=2, gqa=2, head_dim=64, block_size=16)
    case = dataclasses.replace(case, q=case.q * 60)  # scores of a few hundred
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc)
    out = varlen_attention_torch(*args, case.seq_lens, case.scale)
    torch.testing.assert_close(out, naive_attention(case), atol=2e-5, rtol=1e-5)


def test_paged_attention_plan_is_shared_by_layers_with_the_same_cache_shape(monkeypatch):
    """One plan per step serves every layer: a second layer's cache, other values."""
    from shoal.kernels import varlen_attention

    monkeypatch.setattr(varlen_attention, "MAX_KERNEL_QUERY_LEN", 8)  # SDPA takes the prompts
    first = make_paged_case(*MIXED, num_kv_heads=2, gqa=2, head_dim=64, block_size=16)
    second = dataclasses.replace(
        first,
        q=first.q.flip(0),
        k_cache=first.k_cache * -0.5,
        v_cache=first.v_cache * 2,
        dense_k=[k * -0.5 for k in first.dense_k],
        dense_v=[v * 2 for v in first.dense_v],
    )
    tables = (first.block_tables, first.query_start_loc, first.seq_lens)
    plan = ops.plan_paged_attention(first.q, first.k_cache, *tables)
    assert plan is not None and plan.decode is not None and plan.seqs  # both paths in use
    for case in (first, second):
        args = (case.q, case.k_cache, case.v_cache, *tables)
        out = ops.paged_attention(*args, case.scale, plan=plan)
        torch.testing.assert_close(out, naive_attention(case), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 2048], ids=["page-chunks", "3-page-chunks"])
@pytest.mark.parametrize("lens", [MIXED, LONG_DECODE], ids=["mixed", "long"])
def test_sparse_decode_with_contexts_cut_into_chunks(monkeypatch, chunk_bytes, lens):
    """Rows are (chunk, query head); a query's softmax and sum span all of its chunks."""
    from shoal.kernels import sparse_decode

    monkeypatch.setenv("SHOAL_KERNELS", "torch")  # the sparse products, not the C kernel
    monkeypatch.setattr(sparse_decode, "CHUNK_BYTES", chunk_bytes)  # a page holds 2048 B of K
    case = make_paged_case(*lens, num_kv_heads=2, gqa=4, head_dim=64, block_size=4)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc)
    plan = ops.plan_paged_attention(case.q, case.k_cache, *args[3:], case.seq_lens)
    assert len(plan.decode.row_lens) > len(plan.decode.token_rows) * 8  # several chunks
    out = varlen_attention_torch(*args, case.seq_lens, case.scale, plan=plan)
    torch.testing.assert_close(out, naive_attention(case), atol=2e-5, rtol=1e-5)


def test_paged_attention_reference_with_length_hints():
    case = make_paged_case(*DECODE, num_kv_heads=2, gqa=2, head_dim=64, block_size=16)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc)
    out = ops.paged_attention(*args, case.seq_lens, case.scale, max_query_len=1, max_seq_len=65)
    torch.testing.assert_close(out, naive_attention(case), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("lens", [DECODE, ALL_DECODE], ids=["decode", "long"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_reference_matches_dense(gqa, block_size, lens, dtype):
    """The decode reference reads the pages on its own (shuffled, garbage past each table)."""
    case = make_paged_case(
        *lens, num_kv_heads=2, gqa=gqa, head_dim=64, block_size=block_size, dtype=dtype
    )
    tol = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(_decode_reference(case), naive_attention(case), **tol)


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize(
    ("shuffle_pages", "tail_pages"), [(True, 0), (False, 3)], ids=["shuffled", "run+tail"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_torch_path_decodes_match_decode_reference(
    gqa, shuffle_pages, tail_pages, dtype, kernels, monkeypatch
):
    """The fast CPU paths on an all-decode batch (the C kernel where it builds; forced to torch,
    fp32: the sparse products, bf16: one SDPA per sequence over a view or a gather) against the
    decode reference."""
    monkeypatch.setenv("SHOAL_KERNELS", kernels)
    case = make_paged_case(
        *ALL_DECODE, num_kv_heads=2, gqa=gqa, head_dim=64, block_size=4, dtype=dtype,
        shuffle_pages=shuffle_pages, tail_pages=tail_pages,
    )  # fmt: skip
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc)
    out = varlen_attention_torch(*args, case.seq_lens, case.scale)
    tol = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, _decode_reference(case), **tol)


def test_write_kv_scatters_rows_and_skips_negative_slots():
    k_cache = torch.zeros(4, 16, 2, 8)
    v_cache = torch.zeros(4, 16, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    ops.write_kv(key, value, k_cache, v_cache, torch.tensor([37, -1, 5]))
    torch.testing.assert_close(k_cache[2, 5], key[0])
    torch.testing.assert_close(v_cache[0, 5], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # only two slots written


def test_rms_norm_matches_hf_formula_with_fused_residual():
    x, residual, weight = torch.randn(5, 3, 32), torch.randn(5, 3, 32), torch.randn(32)
    out, new_residual = ops.rms_norm(x, weight, 1e-6, residual)
    summed = x + residual
    expected = weight * summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(new_residual, summed)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(ops.rms_norm(summed, weight, 1e-6), expected)


def test_silu_and_mul():
    x = torch.randn(4, 10)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])


def test_fused_moe_reference_matches_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, top_k = 7, 16, 12, 5, 2
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, top_k, generator=gen)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(top_k):
            e = int(topk_ids[t, j])
            h = w13[e] @ x[t]
            expected[t] += topk_weights[t, j] * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    torch.testing.assert_close(fused_moe_torch(x, w13, w2, topk_weights, topk_ids), expected)


@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_rotary_matches_transformers_bit_for_bit(rope_type):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    rope = {"rope_type": rope_type, "rope_theta": 500000.0}
    if rope_type == "llama3":
        rope |= {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters=rope,
    )
    positions = torch.tensor([0, 1, 5, 63, 100, 1000, 4000])
    q, k = torch.randn(7, 4, 64), torch.randn(7, 2, 64)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = ops.build_cos_sin_cache(64, 4096, 500000.0, scaling=rope)
    assert torch.equal(cache[positions], torch.cat((cos[0, :, :32], sin[0, :, :32]), dim=-1))
    out_q, out_k = ops.apply_rotary(q, k, positions, cache)
    assert torch.equal(out_q, hf_q[0].transpose(0, 1))
    assert torch.equal(out_k, hf_k[0].transpose(0, 1))


def test_rms_norm_matches_transformers_in_bf16():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(48, eps=1e-6).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(4, 48).to(torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, norm.weight.detach(), 1e-6), norm(x).detach())


def test_backend_choice_follows_env(monkeypatch):
    from shoal.kernels._backend import use_triton

    cpu = torch.zeros(1)
    monkeypatch.setenv("SHOAL_KERNELS", "torch")
    assert not use_triton(cpu)
    monkeypatch.setenv("SHOAL_KERNELS", "triton")
    assert use_triton(cpu)
    monkeypatch.delenv("SHOAL_KERNELS")
    assert not use_triton(cpu)  # auto: CPU tensors take the torch path
    monkeypatch.setenv("SHOAL_KERNELS", "cuda")
    for _ in range(2):  # refused every time, not only the first
        with pytest.raises(ValueError, match="SHOAL_KERNELS"):
            use_triton(cpu)
    monkeypatch.setenv("SHOAL_KERNELS", " Triton ")  # a value seen again, spelled otherwise
    assert use_triton(cpu)
    monkeypatch.setenv("SHOAL_KERNELS", "torch")
    assert not use_triton(cpu)


def test_fused_moe_reference_matches_transformers_mixtral_experts_bit_for_bit():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=6)
    experts = MixtralExperts(config)
    gen = torch.Generator().manual_seed(1)
    torch.nn.init.normal_(experts.gate_up_proj, generator=gen)
    torch.nn.init.normal_(experts.down_proj, generator=gen)
    x = torch.randn(11, 32, generator=gen)
    topk_ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(11)])
    topk_weights = torch.rand(11, 2, generator=gen)
    with torch.no_grad():
        expected = experts(x, topk_ids, topk_weights)
        out = ops.fused_moe(x, experts.gate_up_proj, experts.down_proj, topk_weights, topk_ids)
    assert torch.equal(out, expected)


def test_sparse_decode_pattern_lists_each_query_heads_slots():
    from shoal.kernels.sparse_decode import plan_decode_pattern

    garbage = 10_000
    block_tables = torch.tensor([[4, 9, garbage], [7, garbage, garbage]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 3], dtype=torch.int32)
    k_cache = torch.zeros(12, 4, 2, 8)  # block_size 4, 2 kv heads: column = slot * 2 + kv_head
    rows = torch.arange(2)
    pattern = plan_decode_pattern(block_tables, seq_lens, rows, rows, k_cache, num_q_heads=4)
    slots = {0: [16, 17, 18, 19, 36, 37], 1: [28, 29, 30]}  # one chunk each (small contexts)
    expected = [
        [slot * 2 + head // 2 for slot in slots[seq]] for seq in (0, 1) for head in range(4)
    ]  # query heads 0 and 1 read kv head 0; 2 and 3 read kv head 1
    where = pattern.where
    assert where.shape == (8, 12 * 4 * 2)
    starts, columns = where.crow_indices().tolist(), where.col_indices().tolist()
    assert [columns[a:b] for a, b in itertools.pairwise(starts)] == expected
    assert pattern.row_lens.tolist() == [6] * 4 + [3] * 4
    assert pattern.row_query.tolist() == list(range(8))


@pytest.mark.parametrize("seed", range(4))
def test_sparse_decode_pattern_matches_a_plain_loop_on_random_tables(seed):
    from shoal.kernels.sparse_decode import plan_decode_pattern

    gen = torch.Generator().manual_seed(seed)
    num_seqs, block_size, num_kv_heads, num_q_heads = 6, 4, 2, 8
    seq_lens = torch.randint(1, 40, (num_seqs,), generator=gen, dtype=torch.int32)
    block_tables = torch.randint(0, 50, (num_seqs, 10), generator=gen, dtype=torch.int32)
    decodes = torch.tensor([0, 2, 3, 5])  # a subset of the batch, in order
    k_cache = torch.zeros(50, block_size, num_kv_heads, 8)
    pattern = plan_decode_pattern(block_tables, seq_lens, decodes, decodes, k_cache, num_q_heads)
    expected = []
    for seq in decodes.tolist():
        slots = [
            int(block_tables[seq, pos // block_size]) * block_size + pos % block_size
            for pos in range(int(seq_lens[seq]))
        ]
        for head in range(num_q_heads):
            expected.append([slot * num_kv_heads + head // 4 for slot in slots])
    starts, columns = pattern.where.crow_indices().tolist(), pattern.where.col_indices().tolist()
    assert [columns[a:b] for a, b in itertools.pairwise(starts)] == expected
