"""Compile every Triton kernel for an NVIDIA GPU (sm_90 by default) without one.

The wrappers are called on small CPU tensors with each kernel replaced by a recorder; each
recorded launch is then compiled ahead of time down to a cubin with Triton's bundled ptxas. This
catches what the interpreter cannot: type errors in the compiled dialect, dot shape limits,
constexpr misuse. Must run WITHOUT ``TRITON_INTERPRET`` (``test_gpu_compile`` spawns it).

    .venv/bin/python -m tests.kernels.gpu_compile [--arch 90] [--dtypes bf16,fp32]
"""

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shoal.kernels import (
    activation,
    decode_attention,
    fused_moe,
    kv_write,
    rms_norm,
    rotary,
    varlen_attention,
)

KERNEL_MODULES = (
    activation,
    decode_attention,
    fused_moe,
    kv_write,
    rms_norm,
    rotary,
    varlen_attention,
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]


class _Recorder:
    def __init__(self, kernel: Any, launches: list[Launch]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


@contextmanager
def recording(launches: list[Launch]) -> Iterator[None]:
    """Replace every ``_*_kernel`` in the kernel modules by a recorder."""
    saved = []
    for module in KERNEL_MODULES:
        for name in dir(module):
            if name.startswith("_") and name.endswith("_kernel"):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, _Recorder(getattr(module, name), launches))
    try:
        yield
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unsupported kernel argument {value!r}")


def compile_launch(launch: Launch, arch: int) -> str:
    """Compile one recorded launch to a cubin; returns a one-line description."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, args, kwargs = launch
    values = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        else:
            signature[param.name] = _arg_type(value)
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32)
    )
    pointer_types = sorted({t for t in signature.values() if t.startswith("*")})
    return f"{kernel.__name__} {pointer_types} {constexprs}: {len(compiled.asm['cubin'])} B"


def record_all(dtype: torch.dtype) -> list[Launch]:
    """Call every wrapper once per kernel variant (splits, tile sizes, residual, rotary styles)."""
    launches: list[Launch] = []
    t, hq, hkv, d, bs = 4, 8, 2, 128, 16
    q = torch.randn(t, hq, d, dtype=dtype)
    k = torch.randn(t, hkv, d, dtype=dtype)
    cache = torch.zeros(8, bs, hkv, d, dtype=dtype)
    table = torch.zeros(t, 4, dtype=torch.int32)
    lens = torch.full((t,), 40, dtype=torch.int32)
    qsl = torch.arange(t + 1, dtype=torch.int32)
    with recording(launches):
        kv_write.write_kv_triton(k, k, cache, cache, torch.arange(t))
        for num_splits in (1, 3):
            decode_args = (q, cache, cache, table, lens, 0.1)
            decode_attention.decode_attention_triton(
                *decode_args, num_splits=num_splits, block_n=64
            )
        for block_m in (16, 64):
            args = (q, cache, cache, table, qsl, lens, 0.1, 1)
            varlen_attention.varlen_attention_triton(*args, block_m=block_m, block_n=64)
        x = torch.randn(t, 96, dtype=dtype)
        rms_norm.rms_norm_triton(x, torch.ones(96, dtype=dtype), 1e-6)
        rms_norm.rms_norm_triton(x, torch.ones(96, dtype=dtype), 1e-6, x)
        cos_sin = rotary.build_cos_sin_cache(64, 32, 10000.0)
        for is_neox in (True, False):
            rotary.apply_rotary_triton(q, k, torch.arange(t), cos_sin, is_neox)
        activation.silu_and_mul_triton(x)
        w13 = torch.randn(4, 64, 96, dtype=dtype)
        w2 = torch.randn(4, 96, 32, dtype=dtype)
        ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3]])
        for block_m in (16, 64):
            fused_moe.fused_moe_triton(x, w13, w2, torch.rand(t, 2), ids, block_m=block_m)
    return launches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dtypes", default="bf16,fp32")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to compile for the GPU", file=sys.stderr)
        return 2
    failures = 0
    for name in args.dtypes.split(","):
        for launch in record_all(DTYPES[name]):
            try:
                print("ok  ", compile_launch(launch, args.arch), flush=True)
            except Exception as exc:  # report every failing kernel, not just the first
                failures += 1
                print(f"FAIL {launch[0].__name__} ({name}): {exc}", flush=True)
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
