"""llama.cpp through llama-cpp-python, built from source in a venv of its own under the peers
cache (``peer_venv``): PyPI ships it as a source package, so ``pip install`` compiles llama.cpp
with the machine's compiler, tuned for this CPU (several minutes on two cores). The reference for
a quantized GGUF's single-request decode (``bench/quantized.py``).

Tuned for this CPU means ``GGML_NATIVE`` where the CPU has no AMX. Where it has AMX, llama.cpp
is built for the CPU's other instruction sets, named one by one from /proc/cpuinfo's flags, and
without its AMX kernels: on a 2-core Xeon with AMX, 0.3.36's AMX int8 product
(``ggml_backend_amx_mul_mat``) crashed with a segmentation fault at the first decode of the
default model. Its AVX512-VNNI kernels run there instead, as on CPUs without AMX. Each build has
its own folder, so a machine of the other kind does not take the first one's venv."""

from __future__ import annotations

from pathlib import Path

from .machine import cpuinfo_field
from .peer_venv import PeerVenv, PeerVenvSpec, ensure_peer_venv

LLAMA_CPP_PIN = "0.3.36"
PROBE = "import json, llama_cpp; print(json.dumps({'llama_cpp_python': llama_cpp.__version__}))"
# /proc/cpuinfo flag -> the ggml option that builds for it (every one but AMX's)
GGML_OPTIONS = {
    "sse4_2": "GGML_SSE42",
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "bmi2": "GGML_BMI2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}


def cmake_args(cpu_flags: set[str]) -> str:
    """llama.cpp's build options for a CPU with these flags: native without AMX, else each
    instruction set but AMX's by name."""
    if "amx_tile" not in cpu_flags:
        return "-DGGML_NATIVE=ON"
    named = [
        f"-D{option}={'ON' if flag in cpu_flags else 'OFF'}"
        for flag, option in GGML_OPTIONS.items()
    ]
    return " ".join(["-DGGML_NATIVE=OFF", *named])


def _install(python: str) -> list[list[str]]:
    package = f"llama-cpp-python=={LLAMA_CPP_PIN}"
    # no wheel from pip's cache: one built with other flags would be taken as it is
    build = ["--no-binary", "llama-cpp-python", "--no-cache-dir"]
    return [[python, "-m", "pip", "install", *build, package]]


def llama_venv_spec(cpu_flags: set[str]) -> PeerVenvSpec:
    """The venv llama.cpp is built into on a CPU with these flags."""
    without_amx = "amx_tile" in cpu_flags
    return PeerVenvSpec(
        name=f"llama-cpp-python {LLAMA_CPP_PIN} (llama.cpp built here"
        + (", without its AMX kernels)" if without_amx else ")"),
        folder="llama-venv-no-amx" if without_amx else "llama-venv",
        install=_install,
        probe=PROBE,
        pinned=lambda versions: versions["llama_cpp_python"] == LLAMA_CPP_PIN,
        env={"CMAKE_ARGS": cmake_args(cpu_flags)},
    )


def ensure_llama_env(log: Path) -> PeerVenv | str:
    """llama.cpp's venv, ready (built the first time), or why it is unavailable."""
    return ensure_peer_venv(llama_venv_spec(set(cpuinfo_field("flags").split())), log)
