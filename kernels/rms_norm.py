"""RMSNorm over the last dimension, with an optional fused residual add: torch and Triton.

Matches Hugging Face's LlamaRMSNorm: normalise in fp32, cast back to the input dtype, then scale
by the weight. With a residual, the sum ``x + residual`` (in the input dtype) is both the new
residual and what gets normalised. Works on any rank (Qwen3's per-head q/k norm passes
``[num_tokens, num_heads, head_dim]``).
"""

import torch

from kernels._triton import require_triton, tl, triton


def rms_norm_torch(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``out`` without residual, else ``(out, x + residual)``."""
    if residual is not None:
        x = x + residual
    hidden = x.float()
    variance = hidden.pow(2).mean(-1, keepdim=True)
    out = weight * (hidden * torch.rsqrt(variance + eps)).to(x.dtype)
    out = out.to(x.dtype)
    return out if residual is None else (out, x)


def rms_norm_triton(*args, **kwargs):  # type: ignore[no-untyped-def]
    """Triton kernel: not written yet."""
    require_triton()
    raise NotImplementedError("rms_norm_triton: Triton kernel not written yet")
