"""Backend choice for every op: Triton on CUDA tensors when Triton imports, else torch.

``SHOAL_KERNELS=torch`` forces the torch references; ``SHOAL_KERNELS=triton`` forces the Triton
kernels (on CPU tensors this only works under ``TRITON_INTERPRET=1``, for tests). The variable is
read on every call so tests can change it.
"""

import os

import torch

from shoal.kernels._triton import HAS_TRITON

ENV_VAR = "SHOAL_KERNELS"
_CHOICES = ("auto", "torch", "triton")


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op on ``tensor`` should run its Triton kernel."""
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r}: expected one of {', '.join(_CHOICES)}")
    if choice == "torch":
        return False
    if choice == "triton":
        if not HAS_TRITON:
            raise RuntimeError(f"{ENV_VAR}=triton but Triton is not installed")
        return True
    return HAS_TRITON and tensor.is_cuda
