"""shoal's C kernels for the CPU (``kernels/cpu/*.c``): compiled when first asked for (a CPU
worker asks at load: ``ops.build_cpu_kernels``) for this machine's
CPU (``-march=native``) and loaded with ctypes; None where they cannot be (no C compiler, a
failed build, not Linux), and the torch paths run instead.

``SHOAL_KERNEL_ARCH`` names the instruction set to build for (``-march``; default ``native``):
e.g. ``x86-64-v3`` builds the AVX2 paths on an AVX-512 machine, for tests or for a cache shared
by different CPUs.

Each library is built once into the shoal cache (``$SHOAL_CACHE_DIR``, else
``$XDG_CACHE_HOME/shoal``, else ``~/.cache/shoal``) under ``kernels/`` (or into
``$SHOAL_KERNEL_CACHE_DIR``), keyed by the source, the
compiler and the CPU's model and flags, and written atomically so concurrent processes agree.
OpenMP comes from the libgomp torch has already loaded (same soname): one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch  # noqa: F401  (loads torch's libgomp before any kernel library)

log = logging.getLogger(__name__)
SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
# 512-bit vectors for the loops gcc vectorizes itself (its default on these CPUs is 256): the
# row-wise kernels and the gated epilogue; prefill of 64 x 128 tokens in bf16 ran 8-10% faster
# on a 2-core Xeon with AMX (four interleaved runs). No effect where the CPU has no AVX-512.
CFLAGS = (
    "-O3",
    "-mprefer-vector-width=512",
    "-fno-trapping-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
)
ARCH_ENV = "SHOAL_KERNEL_ARCH"
KERNEL_CACHE_ENV = "SHOAL_KERNEL_CACHE_DIR"
BUILD_TIMEOUT_S = 120


def _cflags() -> tuple[str, ...]:
    return (f"-march={os.environ.get(ARCH_ENV) or 'native'}", *CFLAGS)


def kernel_cache_dir() -> Path:
    """``$SHOAL_KERNEL_CACHE_DIR``, else ``kernels/`` in the shoal cache."""
    kernels = os.environ.get(KERNEL_CACHE_ENV)
    if kernels:
        return Path(kernels)
    explicit = os.environ.get("SHOAL_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(explicit) if explicit else (Path(xdg) if xdg else Path.home() / ".cache") / "shoal"
    return root / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_identity() -> str:
    """The CPU's model and flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))


def _build_key(source: Path, compiler: str) -> str:
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(SOURCE_DIR.glob("*.h")):  # what the sources may include
        digest.update(header.read_bytes())
    for part in (compiler, " ".join(_cflags()), _cpu_identity()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _compile(source: Path, target: Path, compiler: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [compiler, *_cflags(), "-o", str(built), str(source), "-lm"]
        subprocess.run(command, check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
        os.replace(built, target)


Signature = tuple[str, Any, tuple[Any, ...]]  # (entry point, ctypes result, ctypes arguments)


@functools.cache
def load_kernel_library(name: str, signatures: tuple[Signature, ...] = ()) -> ctypes.CDLL | None:
    """``kernels/cpu/<name>.c`` built for this CPU and loaded, or None (logged once); the entry
    points in ``signatures`` typed. Cached per (name, signatures): call it per use."""
    lib = _load(name)
    if lib is not None:
        for entry, restype, argtypes in signatures:
            fn = getattr(lib, entry)
            fn.restype, fn.argtypes = restype, list(argtypes)
    return lib


def _load(name: str) -> ctypes.CDLL | None:
    source = SOURCE_DIR / f"{name}.c"
    compiler = _compiler()
    if not sys.platform.startswith("linux") or compiler is None:
        log.info("no C compiler: CPU kernel %s unavailable, the torch path runs", name)
        return None
    target = kernel_cache_dir() / f"{name}-{_build_key(source, compiler)}.so"
    try:
        if not target.exists():
            _compile(source, target, compiler)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning(
            "CPU kernel %s could not be built (%s %s): the torch path runs",
            name,
            exc,
            detail.decode(errors="replace")[-400:],
        )
        return None
