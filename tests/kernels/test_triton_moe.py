"""Fused MoE: the expert alignment and the Triton grouped GEMMs against the torch reference."""

import pytest
import torch

from shoal.kernels.fused_moe import align_by_expert, fused_moe_torch, fused_moe_triton
from tests.kernels.on_device import device_under_test


def _moe_case(tokens: int, experts: int, top_k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = 32, 24
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    # expert 0 never chosen: an expert with no tokens
    ids = [torch.randperm(experts - 1, generator=gen)[:top_k] + 1 for _ in range(tokens)]
    topk_ids = torch.stack(ids).to(torch.int32)
    topk_weights = torch.rand(tokens, top_k, generator=gen)
    return x, w13, w2, topk_weights, topk_ids


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"), [(1, 4, 1), (9, 6, 2), (20, 8, 3), (80, 3, 2)]
)
def test_fused_moe_triton_matches_reference(tokens, experts, top_k):
    case = _moe_case(tokens, experts, top_k)
    torch.testing.assert_close(
        fused_moe_triton(*case), fused_moe_torch(*case), atol=1e-5, rtol=1e-5
    )


@pytest.mark.skipif(
    device_under_test() is None,
    reason="bf16 on a GPU only (the interpreter's bf16 is not Triton's)",
)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(9, 6, 2), (80, 8, 2)])
def test_fused_moe_triton_in_bf16(tokens, experts, top_k):
    """bf16 weights and activations against the fp32 reference on the same rounded values."""
    x, w13, w2, weights, ids = _moe_case(tokens, experts, top_k)
    x, w13, w2 = (t.to(torch.bfloat16) for t in (x, w13, w2))
    out = fused_moe_triton(x, w13, w2, weights.to(torch.bfloat16), ids)
    expected = fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=2e-2)


def test_align_by_expert_groups_and_pads_each_expert():
    topk_ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, block_experts = align_by_expert(topk_ids, num_experts=4, block_m=2)
    padding = topk_ids.numel()
    tiles = sorted_ids.view(-1, 2)
    flat = topk_ids.flatten()
    seen = []
    for tile, expert in zip(tiles.tolist(), block_experts.tolist(), strict=True):
        real = [i for i in tile if i != padding]
        if expert < 0:
            assert not real
        assert all(int(flat[i]) == expert for i in real)
        seen += real
    assert sorted(seen) == list(range(padding))
    assert block_experts.tolist()[:4] == [0, 1, 2, 2]
