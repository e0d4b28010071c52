"""SiLU-and-mul (the SwiGLU gate): torch reference and Triton kernel."""

import torch
import torch.nn.functional as F

from shoal.kernels._triton import require_triton, tl, triton


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * inter] -> [.., inter]
    """``silu(gate) * up`` with gate the first half of the last dim and up the second half."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]).mul_(x[..., half:])


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_row_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`silu_and_mul_torch` for ``[num_tokens, 2 * inter]``."""
    require_triton()
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"expected [T, 2 * inter], got {tuple(x.shape)}"
    assert x.stride(1) == 1, "the last dim must be contiguous"
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            x, out, x.stride(0), inter, BLOCK=block
        )
    return out
