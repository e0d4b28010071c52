"""Run the Triton kernel tests on a real GPU: with ``SHOAL_TEST_DEVICE=cuda`` (and
``TRITON_INTERPRET=0``), every ``*_triton`` entry point a test module or ``kernels.ops`` calls
gets its CPU tensors copied to the GPU, runs there, and hands its results back on the CPU
(in-place writes too), so the same tests and references check the compiled kernels.

    SHOAL_TEST_DEVICE=cuda TRITON_INTERPRET=0 python -m pytest tests/kernels/test_triton_*.py
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

DEVICE_ENV = "SHOAL_TEST_DEVICE"


def device_under_test() -> str | None:
    """The accelerator the Triton tests run on (None: the interpreter on the CPU)."""
    return os.environ.get(DEVICE_ENV) or None


def _to(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        return type(value)(_to(v, device) for v in value)
    return value


def on_device(fn: Callable[..., Any], device: str) -> Callable[..., Any]:
    """``fn`` run on ``device``: tensor arguments copied there and back (so in-place writes
    reach the caller's tensors), results returned on the CPU."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        moved_args = [_to(a, device) for a in args]
        moved_kwargs = {k: _to(v, device) for k, v in kwargs.items()}
        out = fn(*moved_args, **moved_kwargs)
        pairs = [*zip(args, moved_args, strict=True)]
        pairs += [(kwargs[k], moved_kwargs[k]) for k in kwargs]
        for before, after in pairs:
            if isinstance(before, torch.Tensor):
                before.copy_(after)
        return _to(out, "cpu")

    return run


def patch_triton_entry_points(
    monkeypatch: pytest.MonkeyPatch, modules: list[ModuleType], device: str
) -> int:
    """Wrap every ``*_triton`` function the modules hold; how many were wrapped."""
    wrapped = 0
    for module in modules:
        for name, value in list(vars(module).items()):
            if name.endswith("_triton") and callable(value):
                monkeypatch.setattr(module, name, on_device(value, device))
                wrapped += 1
    return wrapped
