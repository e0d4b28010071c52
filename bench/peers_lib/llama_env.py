"""llama.cpp through llama-cpp-python, built from source in a venv of its own under the peers
cache (``peer_venv``): PyPI ships it as a source package, so ``pip install`` compiles llama.cpp
with the machine's compiler, tuned for this CPU (``GGML_NATIVE``; several minutes on two
cores). The reference for a quantized GGUF's single-request decode (``bench/quantized.py``)."""

from __future__ import annotations

from pathlib import Path

from .peer_venv import PeerVenv, PeerVenvSpec, ensure_peer_venv

LLAMA_CPP_PIN = "0.3.36"
PROBE = "import json, llama_cpp; print(json.dumps({'llama_cpp_python': llama_cpp.__version__}))"


def _install(python: str) -> list[list[str]]:
    package = f"llama-cpp-python=={LLAMA_CPP_PIN}"
    return [[python, "-m", "pip", "install", "--no-binary", "llama-cpp-python", package]]


LLAMA_VENV = PeerVenvSpec(
    name=f"llama-cpp-python {LLAMA_CPP_PIN} (llama.cpp built here)",
    folder="llama-venv",
    install=_install,
    probe=PROBE,
    pinned=lambda versions: versions["llama_cpp_python"] == LLAMA_CPP_PIN,
    env={"CMAKE_ARGS": "-DGGML_NATIVE=ON"},
)


def ensure_llama_env(log: Path) -> PeerVenv | str:
    """llama.cpp's venv, ready (built the first time), or why it is unavailable."""
    return ensure_peer_venv(LLAMA_VENV, log)
