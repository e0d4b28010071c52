"""A peer engine's venv of its own under the peers cache, made once: ``python -m venv``, then
the peer's pinned install steps. A marker file written last says the venv imports the peer at
its pinned versions; a venv that already does is accepted as it is (marker written, nothing
reinstalled). Any failure gives one line saying why, and the bench goes on without the peer.
``vllm_env`` and ``llama_env`` say what each peer installs and how its versions are read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shoal.workers.built_dir import exclusive_lock

from .cache import peers_cache

MARKER = ".shoal-peers-ready"
PROBE_TIMEOUT_S = 300
INSTALL_TIMEOUT_S = 3600


@dataclass(frozen=True)
class PeerVenvSpec:
    """What one peer's venv holds: ``install`` runs with the venv's python as its argument,
    ``probe`` (Python source) prints the imported versions as one JSON object, and ``pinned``
    says whether they are the ones wanted."""

    name: str  # "vLLM", "llama.cpp": for the messages
    folder: str  # under the peers cache
    install: Callable[[str], list[list[str]]]
    probe: str
    pinned: Callable[[dict[str, str]], bool]
    env: dict[str, str] = field(default_factory=dict)  # for the install steps (a build's flags)


@dataclass(frozen=True)
class PeerVenv:
    """A ready venv: its python and the versions it imports."""

    venv: Path
    versions: dict[str, str]

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def ensure_peer_venv(spec: PeerVenvSpec, log: Path) -> PeerVenv | str:
    """The venv, ready (made or accepted the first time), or why it is unavailable."""
    venv = peers_cache() / spec.folder
    venv.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(venv.parent / f".{spec.folder}.lock"):
        marker = venv / MARKER
        if marker.is_file() and (venv / "bin" / "python").is_file():
            return PeerVenv(venv, json.loads(marker.read_text()))
        versions = probe(spec, venv)
        if versions is None:
            print(f"installing {spec.name} into {venv} (once; log: {log})", flush=True)
            try:
                install(spec, venv, log)
            except (OSError, subprocess.SubprocessError) as exc:
                return (
                    f"{spec.name}'s venv could not be installed ({type(exc).__name__}: {exc}); "
                    f"log: {log}"
                )
            versions = probe(spec, venv)
        if versions is None:
            return f"{spec.name} does not import at its pinned version in {venv}; log: {log}"
        marker.write_text(json.dumps(versions))
        return PeerVenv(venv, versions)


def probe(spec: PeerVenvSpec, venv: Path) -> dict[str, str] | None:
    """The versions the venv imports, when they are the pinned ones; else None."""
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    try:
        done = subprocess.run(
            [str(python), "-c", spec.probe], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    versions = json.loads(done.stdout.strip().splitlines()[-1])
    return versions if spec.pinned(versions) else None


def install(spec: PeerVenvSpec, venv: Path, log: Path) -> None:
    """The venv created (if missing) and the peer installed into it; raises on failure."""
    python = str(venv / "bin" / "python")
    steps = spec.install(python)
    if not (venv / "bin" / "python").is_file():
        steps = [[sys.executable, "-m", "venv", str(venv)], *steps]
    with open(log, "a") as out:
        for step in steps:
            out.write(f"$ {' '.join(step)}\n")
            out.flush()
            subprocess.run(
                step,
                stdout=out,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=INSTALL_TIMEOUT_S,
                env={**os.environ, **spec.env},
            )
