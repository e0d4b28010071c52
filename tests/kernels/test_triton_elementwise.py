"""KV write, RMSNorm, rotary and SiLU-and-mul Triton kernels against their torch references."""

import pytest
import torch

from shoal.kernels.activation import silu_and_mul_torch, silu_and_mul_triton
from shoal.kernels.kv_write import write_kv_torch, write_kv_triton
from shoal.kernels.rms_norm import rms_norm_torch, rms_norm_triton
from shoal.kernels.rotary import apply_rotary_torch, apply_rotary_triton, build_cos_sin_cache

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (2, 128), (3, 64)])
def test_write_kv_triton_matches_reference(block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size + head_dim)
    num_tokens = 11
    # key/value are strided views into a fused projection, as the model produces them
    fused = torch.randn(num_tokens, 3, num_kv_heads * head_dim, generator=gen)
    key = fused[:, 1].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, 2].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(5 * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1
    caches = [torch.randn(5, block_size, num_kv_heads, head_dim, generator=gen) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    write_kv_triton(key, value, *caches, slots)
    write_kv_torch(key, value, *ref_caches, slots)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


@pytest.mark.parametrize("shape", [(7, 64), (5, 3, 128), (4, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_triton_matches_reference(shape, with_residual):
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen)
    weight = torch.randn(shape[-1], generator=gen)
    residual = torch.randn(shape, generator=gen) if with_residual else None
    out = rms_norm_triton(x, weight, 1e-5, residual)
    expected = rms_norm_torch(x, weight, 1e-5, residual)
    if with_residual:
        torch.testing.assert_close(out[0], expected[0])
        assert torch.equal(out[1], expected[1])
    else:
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (128, 128), (64, 32)])
@pytest.mark.parametrize("gqa", [1, 4])
def test_rotary_triton_matches_reference(is_neox, head_dim, rotary_dim, gqa):
    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    num_tokens, num_kv_heads = 6, 2
    num_q_heads = num_kv_heads * gqa
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k_end = (num_q_heads + num_kv_heads) * head_dim
    k = qkv[:, num_q_heads * head_dim : k_end].view(num_tokens, num_kv_heads, head_dim)
    cache = build_cos_sin_cache(rotary_dim, 512, 10000.0, scaling=LLAMA3)
    positions = torch.tensor([0, 1, 7, 63, 200, 511])
    q_out, k_out = apply_rotary_triton(q, k, positions, cache, is_neox)
    q_ref, k_ref = apply_rotary_torch(q, k, positions, cache, is_neox)
    torch.testing.assert_close(q_out, q_ref)
    torch.testing.assert_close(k_out, k_ref)
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("shape", [(3, 64), (5, 2 * 1500), (1, 2 * 24)])
def test_silu_and_mul_triton_matches_reference(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1]))
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_torch(x))
