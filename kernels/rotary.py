"""Rotary position embedding: the cos/sin cache builder, torch reference and Triton kernel.

The cache is ``[max_positions, rotary_dim]`` laid out as ``cat(cos, sin)``, each of
``rotary_dim // 2`` columns. Only the first ``rotary_dim`` features of each head rotate (partial
rotary); the rest pass through. ``is_neox`` pairs feature ``i`` with ``i + rotary_dim // 2``
(Llama/Qwen/Mistral); otherwise features ``2i`` and ``2i + 1`` are paired (GPT-J).
"""

import math
from typing import Any

import torch

from shoal.kernels._triton import require_triton, tl, triton


def _inverse_frequencies(rotary_dim: int, base: float) -> torch.Tensor:  # [rotary_dim // 2]
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float) / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling, computed as transformers' ``_compute_llama3_parameters``."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(
    rotary_dim: int,
    max_positions: int,
    base: float,
    *,
    scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [max_positions, rotary_dim]
    """cat(cos, sin) per position; ``scaling`` is a HF rope dict (``rope_type`` default/llama3), or
    ``freq_factors`` with one divisor per frequency (a GGUF file's ``rope_freqs``).

    Keep the cache in fp32 (the default): ``apply_rotary`` casts rows to the activations' dtype
    the way transformers does.
    """
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    inv_freq = _inverse_frequencies(rotary_dim, base)
    if rope_type == "llama3":
        assert scaling is not None
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif rope_type == "freq_factors":  # a GGUF file's rope_freqs: a divisor per frequency
        assert scaling is not None
        inv_freq = inv_freq / torch.tensor(scaling["freq_factors"], dtype=inv_freq.dtype)
    elif rope_type not in ("default", None):
        raise NotImplementedError(
            f"rope_type {rope_type!r} is not supported (default, llama3, freq_factors)"
        )
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotary_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _rotate_torch(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, rotary_dim // 2]
    sin: torch.Tensor,
    is_neox: bool,
) -> torch.Tensor:
    """Each rotated half written straight into the output (transformers' arithmetic, in its
    order, without its concatenations)."""
    half = cos.shape[-1]
    rotary_dim = 2 * half
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if is_neox:
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        out1, out2 = out[..., :half], out[..., half:rotary_dim]
    else:
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out1, out2 = out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2]
    torch.sub(x1 * cos, x2 * sin, out=out1)
    torch.add(x2 * cos, x1 * sin, out=out2)
    if rotary_dim < x.shape[-1]:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    return out


def apply_rotary_torch(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim]
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and k, computed in their dtype as transformers does."""
    cos_sin = cos_sin_cache[positions.long()].to(q.dtype)  # [num_tokens, rotary_dim]
    cos, sin = cos_sin[:, None, :].chunk(2, dim=-1)  # [num_tokens, 1, rotary_dim // 2]
    return _rotate_torch(q, cos, sin, is_neox), _rotate_torch(k, cos, sin, is_neox)


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    src_stride_h,
    num_heads,
    head_dim,
    cos,
    sin,
    half,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (pairs < half)
    if IS_NEOX:
        first, second = pairs, pairs + half
    else:
        first, second = 2 * pairs, 2 * pairs + 1
    x1 = tl.load(src_ptr + heads * src_stride_h + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + heads * src_stride_h + second, mask=mask, other=0.0).to(tl.float32)
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst_ptr + heads * head_dim + first, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(dst_ptr + heads * head_dim + second, (x2 * cos + x1 * sin).to(out_ty), mask=mask)
    if BLOCK_PASS > 0:
        dims = 2 * half + tl.arange(0, BLOCK_PASS)[None, :]
        pass_mask = (heads < num_heads) & (dims < head_dim)
        rest = tl.load(src_ptr + heads * src_stride_h + dims, mask=pass_mask)
        tl.store(dst_ptr + heads * head_dim + dims, rest, mask=pass_mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cache_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    cache_stride,
    num_q_heads,
    num_kv_heads,
    head_dim,
    half,
    IS_NEOX: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    row = cache_ptr + position * cache_stride
    cos = tl.load(row + pairs, mask=pairs < half, other=0.0).to(q_ptr.dtype.element_ty)
    sin = tl.load(row + half + pairs, mask=pairs < half, other=0.0).to(q_ptr.dtype.element_ty)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    _rotate_heads(
        q_ptr + token * q_stride_t,
        q_out_ptr + token * num_q_heads * head_dim,
        q_stride_h, num_q_heads, head_dim, cos, sin, half,
        IS_NEOX, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + token * k_stride_t,
        k_out_ptr + token * num_kv_heads * head_dim,
        k_stride_h, num_kv_heads, head_dim, cos, sin, half,
        IS_NEOX, BLOCK_HK, BLOCK_HALF, BLOCK_PASS,
    )  # fmt: skip


def _passthrough_block(head_dim: int, rotary_dim: int) -> int:
    return 0 if rotary_dim == head_dim else triton.next_power_of_2(head_dim - rotary_dim)


def apply_rotary_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`apply_rotary_torch`; q and k may be strided views (e.g. slices
    of a fused qkv projection) as long as their last dim is contiguous."""
    require_triton()
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, k.shape
    assert q.stride(2) == 1 and k.stride(2) == 1, "the head dim must be contiguous"
    assert q.dtype == k.dtype, f"q {q.dtype} != k {k.dtype}"
    assert positions.shape == (num_tokens,) and not positions.is_floating_point()
    rotary_dim = cos_sin_cache.shape[1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim and cos_sin_cache.stride(1) == 1
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            num_q_heads, k.shape[1], head_dim, rotary_dim // 2,
            IS_NEOX=is_neox,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
            BLOCK_PASS=_passthrough_block(head_dim, rotary_dim),
        )  # fmt: skip
    return q_out, k_out
