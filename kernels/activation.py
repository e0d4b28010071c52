"""SiLU-and-mul (the SwiGLU gate): torch reference and Triton kernel."""

import torch
import torch.nn.functional as F

from kernels._triton import require_triton, tl, triton


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * inter] -> [.., inter]
    """``silu(gate) * up`` with gate the first half of the last dim and up the second half."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def silu_and_mul_triton(*args, **kwargs):  # type: ignore[no-untyped-def]
    """Triton kernel: not written yet."""
    require_triton()
    raise NotImplementedError("silu_and_mul_triton: Triton kernel not written yet")
