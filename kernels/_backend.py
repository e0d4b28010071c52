"""Backend choice for every op: Triton on CUDA tensors when Triton imports, else torch (and,
on the CPU, shoal's C kernels where they build: ``cpu_build``).

``SHOAL_KERNELS=torch`` forces the torch references (no C kernels either);
``SHOAL_KERNELS=triton`` forces the Triton kernels (on CPU tensors this only works under
``TRITON_INTERPRET=1``, for tests). The variable is read on every call so tests can change it;
the read goes straight to the dict behind ``os.environ`` where CPython has one (a few hundred
ops a step each asked: ``os.environ.get`` of an unset name took ~0.85 µs here, a step's 0.3 ms).
"""

import os

import torch

from shoal.kernels._triton import HAS_TRITON

ENV_VAR = "SHOAL_KERNELS"
_CHOICES = ("auto", "torch", "triton")
_ENV_DATA = getattr(os.environ, "_data", None)  # CPython: the mapping os.environ writes through
_ENV_KEY = getattr(os.environ, "encodekey", str)(ENV_VAR)
_parsed: dict[object, str] = {}  # the variable's raw value -> the choice it names


def _raw_setting() -> object:
    if isinstance(_ENV_DATA, dict):
        return _ENV_DATA.get(_ENV_KEY)
    return os.environ.get(ENV_VAR)


def _choice() -> str:
    raw = _raw_setting()
    choice = _parsed.get(raw)
    if choice is None:
        choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
        if choice not in _CHOICES:
            raise ValueError(f"{ENV_VAR}={choice!r}: expected one of {', '.join(_CHOICES)}")
        _parsed[raw] = choice
    return choice


def use_cpu_kernels() -> bool:
    """Whether the torch path may hand work to shoal's C kernels (not when forced to torch)."""
    return _choice() != "torch"


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op on ``tensor`` should run its Triton kernel."""
    choice = _choice()
    if choice == "auto":
        return HAS_TRITON and tensor.is_cuda
    if choice == "torch":
        return False
    if not HAS_TRITON:
        raise RuntimeError(f"{ENV_VAR}=triton but Triton is not installed")
    return True
