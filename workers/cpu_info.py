"""What this machine's CPU offers the workers: its instruction-set flags (from /proc/cpuinfo),
whether it multiplies bf16 natively, and the dtype ``--dtype auto`` means on it.

``--dtype auto`` on the CPU is bf16 where the CPU has bf16 dot products (AVX512-BF16) or matrix
units (AMX-BF16), as vLLM's CPU backend picks, and fp32 elsewhere; ``SHOAL_AUTO_DTYPE`` overrides
that choice for a host (e.g. ``float32`` to compare with fp32 references).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

AUTO_DTYPE_ENV = "SHOAL_AUTO_DTYPE"
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the first CPU lists (empty where /proc/cpuinfo is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    return bool(BF16_FLAGS & (cpu_flags() if flags is None else flags))


def auto_cpu_dtype(flags: frozenset[str] | None = None) -> str:
    """What ``--dtype auto`` serves on this CPU (``SHOAL_AUTO_DTYPE`` first), by name."""
    if override := os.environ.get(AUTO_DTYPE_ENV, "").strip():
        return override
    return "bfloat16" if has_native_bf16(flags) else "float32"
