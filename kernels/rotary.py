"""Rotary position embedding: the cos/sin cache builder, torch reference and Triton kernel.

The cache is ``[max_positions, rotary_dim]`` laid out as ``cat(cos, sin)``, each of
``rotary_dim // 2`` columns. Only the first ``rotary_dim`` features of each head rotate (partial
rotary); the rest pass through. ``is_neox`` pairs feature ``i`` with ``i + rotary_dim // 2``
(Llama/Qwen/Mistral); otherwise features ``2i`` and ``2i + 1`` are paired (GPT-J).
"""

import math
from typing import Any

import torch

from kernels._triton import require_triton, tl, triton


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
    """cat(cos, sin) per position; ``scaling`` is a HF rope dict (``rope_type`` default/llama3).

    Keep the cache in fp32 (the default): ``apply_rotary`` casts rows to the activations' dtype
    the way transformers does.
    """
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    inv_freq = _inverse_frequencies(rotary_dim, base)
    if rope_type == "llama3":
        assert scaling is not None
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif rope_type not in ("default", None):
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported (default, llama3)")
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotary_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _rotate_torch(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, rotary_dim // 2]
    sin: torch.Tensor,
    is_neox: bool,
) -> torch.Tensor:
    rotary_dim = cos.shape[-1] * 2
    rot, passthrough = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    if is_neox:
        rotated = torch.cat((out1, out2), dim=-1)
    else:
        rotated = torch.stack((out1, out2), dim=-1).flatten(-2)
    return torch.cat((rotated, passthrough), dim=-1)


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


def apply_rotary_triton(*args, **kwargs):  # type: ignore[no-untyped-def]
    """Triton kernel: not written yet."""
    require_triton()
    raise NotImplementedError("apply_rotary_triton: Triton kernel not written yet")
