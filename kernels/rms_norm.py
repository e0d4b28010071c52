"""RMSNorm over the last dimension, with an optional fused residual add: torch and Triton.

Matches Hugging Face's LlamaRMSNorm: normalise in fp32, cast back to the input dtype, then scale
by the weight. With a residual, the sum ``x + residual`` (in the input dtype) is both the new
residual and what gets normalised. Works on any rank (Qwen3's per-head q/k norm passes
``[num_tokens, num_heads, head_dim]``).
"""

import torch

from shoal.kernels._triton import require_triton, tl, triton


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


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    x_row_stride,
    residual_row_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * hidden + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask
    )


def _as_rows(t: torch.Tensor, hidden: int) -> torch.Tensor:  # [rows, hidden], unit last stride
    rows = t.reshape(-1, hidden)
    return rows if rows.stride(1) == 1 else rows.contiguous()


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rms_norm_torch` (one program per row of the last dim)."""
    require_triton()
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} != ({hidden},)"
    assert weight.is_contiguous() and weight.device == x.device
    x_rows = _as_rows(x, hidden)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else out
    residual_rows = x_rows
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
        residual_rows = _as_rows(residual, hidden)
    num_rows = x_rows.shape[0]
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x_rows,
            residual_rows,
            weight,
            out,
            new_residual,
            x_rows.stride(0),
            residual_rows.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out if residual is None else (out, new_residual)
