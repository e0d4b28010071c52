"""Expert parallelism: the placement of experts on ranks, the pure dispatch/combine index math
(hypothesis), loading only this rank's experts through the real loader path (per-expert and
fused checkpoint tensors), and two real gloo processes whose EP=2 MoE blocks, fed different
token batches (one rank idle), match the replicated block; and whole EP=2 models, built by
``load_model(..., ep=...)``, whose prefill logits on each rank's own prompts match the replicated
model's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from shoal.workers.layers.attention import AttentionMetadata
from shoal.workers.layers.moe import SparseMoeBlock
from shoal.workers.loader import load_model
from shoal.workers.moe.expert_parallel import (
    EPContext,
    combine_into_tokens,
    inverse_permutation,
    pack_pairs,
    plan_dispatch,
    unpack_pairs,
)
from tests.fixtures.models import build_checkpoint
from tests.unit.ep_ranks import join_gloo, run_two_ranks

# tokens per rank in each round: different batches, and idle rounds (rank 0 twice, rank 1 once)
ROUNDS = [(5, 3), (0, 4), (0, 2), (6, 0), (1, 2)]


# ---- placement -----------------------------------------------------------------------------


def test_each_rank_owns_a_contiguous_share_of_the_experts() -> None:
    assert [EPContext(r, 2).local_experts(4) for r in (0, 1)] == [range(0, 2), range(2, 4)]
    assert list(EPContext(2, 3).local_experts(6)) == [4, 5]
    owners = EPContext(0, 4).owner_of(torch.tensor([[0, 7], [3, 4]]), 8)
    assert owners.tolist() == [[0, 3], [1, 2]]
    with pytest.raises(
        ValueError, match="num_experts=6 is not divisible by expert-parallel size 4"
    ):
        EPContext(0, 4).local_experts(6)
    for rank, size in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="bad expert-parallel rank"):
            EPContext(rank, size)


# ---- pure index math -----------------------------------------------------------------------


@st.composite
def routings(draw: Any) -> tuple[torch.Tensor, EPContext, int]:
    size = draw(st.integers(1, 4))
    num_experts = size * draw(st.integers(1, 3))
    tokens = draw(st.integers(0, 9))
    top_k = draw(st.integers(1, 3))
    flat = draw(
        st.lists(st.integers(0, num_experts - 1), min_size=tokens * top_k, max_size=tokens * top_k)
    )
    ids = torch.tensor(flat, dtype=torch.int64).reshape(tokens, top_k)
    return ids, EPContext(draw(st.integers(0, size - 1)), size), num_experts


@settings(max_examples=150, deadline=None)
@given(routings())
def test_dispatch_sorts_pairs_by_owner_and_the_inverse_restores_them(case: Any) -> None:
    ids, ep, num_experts = case
    plan = plan_dispatch(ids, ep, num_experts)
    flat = ids.reshape(-1)
    assert sum(plan.send_counts) == flat.numel() and len(plan.send_counts) == ep.size
    assert sorted(plan.order.tolist()) == list(range(flat.numel()))  # a permutation
    owners = ep.owner_of(flat[plan.order], num_experts).tolist()
    assert owners == sorted(owners)  # grouped by destination rank, in rank order
    expected = [sum(1 for o in owners if o == r) for r in range(ep.size)]
    assert plan.send_counts == expected
    inv = inverse_permutation(plan.order)
    assert torch.equal(flat[plan.order][inv], flat)  # round trip is the identity
    assert torch.equal(plan.order[inv], torch.arange(flat.numel()))
    top_k = ids.shape[1]
    assert torch.equal(plan.token_of, plan.order // top_k)


@settings(max_examples=100, deadline=None)
@given(routings())
def test_combine_sums_each_tokens_weighted_results_in_token_order(case: Any) -> None:
    ids, ep, num_experts = case
    tokens, top_k = ids.shape
    gen = torch.Generator().manual_seed(tokens * 31 + top_k)
    x = torch.randn(tokens, 3, generator=gen, dtype=torch.float64)
    weights = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64)
    plan = plan_dispatch(ids, ep, num_experts)
    # an "expert" that scales by (id + 1): results travel in sorted-pair order
    scale = (ids.reshape(-1)[plan.order] + 1).to(x.dtype)[:, None]
    results = x[plan.token_of] * scale * weights.reshape(-1)[plan.order][:, None]
    out = combine_into_tokens(results, plan, tokens)
    want = torch.einsum("tk,tk,th->th", weights, (ids + 1).to(x.dtype), x)
    assert out.shape == (tokens, 3)
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_pairs", [0, 1, 5])
def test_packed_pairs_unpack_to_the_same_tensors(dtype: torch.dtype, num_pairs: int) -> None:
    """The dispatch travels as one byte row per pair: hidden state, expert id, weight."""
    gen = torch.Generator().manual_seed(num_pairs)
    x = torch.randn(num_pairs, 6, generator=gen).to(dtype)
    ids = torch.randint(0, 1 << 40, (num_pairs,), generator=gen)
    weights = torch.rand(num_pairs, generator=gen).to(dtype)
    packed = pack_pairs(x, ids, weights)
    assert packed.dtype == torch.uint8 and packed.shape[0] == num_pairs
    got_x, got_ids, got_weights = unpack_pairs(packed, 6, dtype)
    assert torch.equal(got_x, x) and torch.equal(got_ids, ids)
    assert torch.equal(got_weights, weights)


def test_expert_ids_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match=r"expert ids outside \[0, 4\)"):
        plan_dispatch(torch.tensor([[1, 4]]), EPContext(0, 2), 4)


# ---- loading only this rank's experts -----------------------------------------------------


def fuse_experts(model_dir: Path, out_dir: Path, num_layers: int = 2) -> Path:
    """A copy of a per-expert Mixtral checkpoint with transformers 5.x fused expert tensors."""
    import shutil

    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.block_sparse_moe"
        w1, w3, w2 = (
            [tensors.pop(f"{prefix}.experts.{e}.{w}.weight") for e in range(4)]
            for w in ("w1", "w3", "w2")
        )
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(w1, w3, strict=True)]
        )
        tensors[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(w2)
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = tensors.pop(f"{prefix}.gate.weight")
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def load_ep_model(model_dir: Path, ep: EPContext) -> Any:
    """The model with every sparse block's experts spread by ``ep``, loaded from disk through
    the loader's own path (``load_model(..., ep=...)``: build, ``load_weights``, completeness)."""
    model, _ = load_model(model_dir, dtype=torch.float32, max_positions=64, ep=ep)
    return model


def moe_blocks(model: Any) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ep")
    mixtral = build_checkpoint("mixtral", root / "mixtral", with_tokenizer=False)
    return {
        "mixtral": mixtral,
        "mixtral_fused": fuse_experts(mixtral, root / "mixtral_fused"),
        "qwen2_moe": build_checkpoint("qwen2_moe", root / "qwen2_moe", with_tokenizer=False),
    }


def check_holds_own_experts(ep_model: Any, full_model: Any, ep: EPContext) -> None:
    ep_blocks, full_blocks = moe_blocks(ep_model), moe_blocks(full_model)
    assert ep_blocks and len(ep_blocks) == len(full_blocks)
    for ep_block, full in zip(ep_blocks, full_blocks, strict=True):
        mine = list(ep.local_experts(4))
        assert ep_block.experts.w13.shape[0] == ep_block.experts.w2.shape[0] == len(mine)
        assert torch.equal(ep_block.experts.w13, full.experts.w13[mine])
        assert torch.equal(ep_block.experts.w2, full.experts.w2[mine])
        assert torch.equal(ep_block.gate.weight, full.gate.weight)  # the router is replicated
        if full.shared_expert is not None:
            for (name, a), (_, b) in zip(
                ep_block.shared_expert.named_parameters(),  # type: ignore[union-attr]
                full.shared_expert.named_parameters(),
                strict=True,
            ):
                assert torch.equal(a, b), name


@pytest.mark.parametrize("variant", ["mixtral", "mixtral_fused", "qwen2_moe"])
def test_each_rank_loads_only_its_experts(checkpoints: dict[str, Path], variant: str) -> None:
    full, _ = load_model(checkpoints[variant], dtype=torch.float32)
    for rank in (0, 1):
        ep = EPContext(rank, 2)
        check_holds_own_experts(load_ep_model(checkpoints[variant], ep), full, ep)


def test_a_rank_needs_only_its_own_experts_on_disk(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    from shoal.workers.loader import CheckpointError

    broken = Path(shutil.copytree(checkpoints["mixtral"], tmp_path / "no_expert_3"))
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    load_ep_model(broken, EPContext(0, 2))  # experts 0-1: nothing of its own is missing
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.experts\.w2 \(parts \(3, None\)"):
        load_ep_model(broken, EPContext(1, 2))


def test_a_group_of_one_holds_every_expert_and_needs_no_process_group(
    checkpoints: dict[str, Path],
) -> None:
    full, _ = load_model(checkpoints["qwen2_moe"], dtype=torch.float32)
    alone = load_ep_model(checkpoints["qwen2_moe"], EPContext(0, 1))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    for ep_block, block in zip(moe_blocks(alone), moe_blocks(full), strict=True):
        assert torch.equal(ep_block.experts.w13, block.experts.w13)
        assert torch.equal(ep_block(x), block(x))


def test_a_dense_model_ignores_the_expert_parallel_context(tmp_path: Path) -> None:
    path = build_checkpoint("qwen2", tmp_path / "qwen2", with_tokenizer=False)
    full, _ = load_model(path, dtype=torch.float32, max_positions=64)
    ep_model = load_ep_model(path, EPContext(1, 2))  # no process group: nothing collective
    for (name, a), (_, b) in zip(full.named_parameters(), ep_model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    prompt = torch.tensor([3, 1, 4, 1, 5])
    assert torch.equal(prefill_logits(ep_model, [prompt]), prefill_logits(full, [prompt]))


# ---- two real processes --------------------------------------------------------------------


def _rank_main(rank: int, port: int, dirs: dict[str, str], answers: Any) -> None:
    """One EP rank: each variant's EP=2 blocks on this rank's tokens vs the replicated ones."""
    try:
        join_gloo(rank, port)
        ep = EPContext(rank, 2)
        report: dict[str, Any] = {}
        for v, (variant, path) in enumerate(sorted(dirs.items())):
            full, _ = load_model(path, dtype=torch.float32)
            ep_model = load_ep_model(Path(path), ep)
            check_holds_own_experts(ep_model, full, ep)
            for b, (ep_block, block) in enumerate(
                zip(moe_blocks(ep_model), moe_blocks(full), strict=True)
            ):
                for r, counts in enumerate(ROUNDS):
                    gen = torch.Generator().manual_seed(1000 * v + 100 * b + 10 * r + rank)
                    x = torch.randn(counts[rank], 64, generator=gen)
                    with torch.inference_mode():
                        got, want = ep_block(x), block(x)
                    assert got.shape == want.shape == (counts[rank], 64)
                    scale = want.abs().max().item() if len(x) else 1.0
                    report[f"{variant}/{b}/{r}"] = (
                        torch.allclose(got, want, rtol=1e-5, atol=1e-6 * scale),
                        scale,
                    )
        answers.put((rank, report))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the test
        answers.put((rank, repr(exc)))


@pytest.mark.timeout(240)
def test_ep2_blocks_match_the_replicated_block_across_two_processes(
    checkpoints: dict[str, Path],
) -> None:
    results = run_two_ranks(_rank_main, {k: str(p) for k, p in checkpoints.items()})
    for rank in (0, 1):
        report = results[rank]
        assert isinstance(report, dict), f"rank {rank}: {report}"
        assert len(report) == 3 * 2 * len(ROUNDS)
        assert all(close for close, _ in report.values()), f"rank {rank}: {report}"
        assert all(scale > 0.1 for _, scale in report.values())  # outputs are not trivial


# ---- whole models: load_model(..., ep=...) across two processes ----------------------------

BLOCK_SIZE = 16
# prompt lengths per rank in each forward: both ranks run every forward (the all-to-alls are
# collective); one rank's batch is a single token
FORWARDS = [([5, 3], [1]), ([2], [4, 7]), ([1], [9])]


def prefill_logits(model: Any, prompts: list[torch.Tensor]) -> torch.Tensor:
    """Every token's fp32 logits for one forward prefilling ``prompts`` from empty caches."""
    cfg = model.config
    blocks = [-(-len(p) // BLOCK_SIZE) for p in prompts]
    for layer in model.attention_layers():
        shape = (sum(blocks), BLOCK_SIZE, layer.num_kv_heads, cfg.head_dim)
        layer.bind_cache(torch.zeros(shape), torch.zeros(shape))
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    table = torch.zeros(len(prompts), max(blocks), dtype=torch.int32)
    first = 0
    for row, n in enumerate(blocks):
        table[row, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    rows = torch.repeat_interleave(torch.arange(len(prompts)), lens.long())
    slots = table[rows, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=table,
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0)]).int(),
        seq_lens=lens,
        max_query_len=int(lens.max()),
        max_seq_len=int(lens.max()),
    )
    with torch.inference_mode():
        return model.compute_logits(model(torch.cat(prompts), positions, meta))


def _model_rank_main(rank: int, port: int, dirs: dict[str, str], answers: Any) -> None:
    """One EP rank: each family's EP=2 model on this rank's prompts vs the replicated model."""
    try:
        join_gloo(rank, port)
        report: dict[str, Any] = {}
        for v, (variant, path) in enumerate(sorted(dirs.items())):
            full, cfg = load_model(path, dtype=torch.float32, max_positions=64)
            ep_model, _ = load_model(
                path, dtype=torch.float32, max_positions=64, ep=EPContext(rank, 2)
            )
            check_holds_own_experts(ep_model, full, EPContext(rank, 2))
            for f, lengths in enumerate(FORWARDS):
                gen = torch.Generator().manual_seed(100 * v + 10 * f + rank)
                prompts = [
                    torch.randint(cfg.vocab_size, (n,), generator=gen) for n in lengths[rank]
                ]
                got, want = prefill_logits(ep_model, prompts), prefill_logits(full, prompts)
                assert got.shape == want.shape == (sum(lengths[rank]), cfg.vocab_size)
                scale = want.abs().max().item()
                report[f"{variant}/{f}"] = (
                    torch.allclose(got, want, rtol=1e-5, atol=1e-5 * scale),
                    (got - want).abs().max().item(),
                    scale,
                )
        answers.put((rank, report))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the test
        answers.put((rank, repr(exc)))


@pytest.mark.timeout(240)
def test_ep2_models_from_load_model_match_the_replicated_model_across_two_processes(
    checkpoints: dict[str, Path],
) -> None:
    dirs = {k: str(checkpoints[k]) for k in ("mixtral", "qwen2_moe")}
    results = run_two_ranks(_model_rank_main, dirs)
    for rank in (0, 1):
        report = results[rank]
        assert isinstance(report, dict), f"rank {rank}: {report}"
        assert len(report) == 2 * len(FORWARDS)
        assert all(close for close, _, _ in report.values()), f"rank {rank}: {report}"
        assert all(scale > 0.1 for _, _, scale in report.values())  # logits are not trivial
