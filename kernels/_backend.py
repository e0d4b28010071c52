"""Backend choice for every op: Triton on CUDA tensors when Triton imports, else torch (and,
on the CPU, shoal's C kernels where they build: ``cpu_build``).

``SHOAL_KERNELS=torch`` forces the torch references (no C kernels either);
``SHOAL_KERNELS=triton`` forces the Triton kernels (on CPU tensors this only works under
``TRITON_INTERPRET=1``, for tests). The variable is read on every call so tests can change it.
"""

import os

import torch

from shoal.kernels._triton import HAS_TRITON

ENV_VAR = "SHOAL_KERNELS"
_CHOICES = ("auto", "torch", "triton")


def _choice() -> str:
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r}: expected one of {', '.join(_CHOICES)}")
    return choice


def use_cpu_kernels() -> bool:
    """Whether the torch path may hand work to shoal's C kernels (not when forced to torch)."""
    return _choice() != "torch"


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op on ``tensor`` should run its Triton kernel."""
    choice = _choice()
    if choice == "torch":
        return False
    if choice == "triton":
        if not HAS_TRITON:
            raise RuntimeError(f"{ENV_VAR}=triton but Triton is not installed")
        return True
    return HAS_TRITON and tensor.is_cuda
