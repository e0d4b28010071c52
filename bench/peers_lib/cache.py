"""The peers cache (``<shoal cache>/peers``) and the Hugging Face directory every engine loads:
the GGUF checkpoint dequantized once by ``peers_engines/make_hf.py`` in a child process, kept
under a name keyed by the GGUF file's size and modification time (a changed file gets a new
directory), built under shoal's lock-and-rename helper so a crash leaves nothing half-made."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shoal.workers.built_dir import default_cache_root, ensure_built

ENGINES_DIR = Path(__file__).resolve().parents[1] / "peers_engines"
MANIFEST = "peers-hf.json"
CONVERT_TIMEOUT_S = 1800


def peers_cache() -> Path:
    """``<SHOAL_CACHE_DIR or ~/.cache/shoal>/peers``."""
    return default_cache_root() / "peers"


def default_gguf() -> Path:
    """The default model's GGUF file, as ``shoal serve`` resolves it (its view's source)."""
    from shoal.deploy.model_source import resolve_model
    from shoal.workers.gguf import gguf_source

    view = resolve_model(None).directory
    source = gguf_source(view)
    if source is None:
        raise RuntimeError(f"the default model's directory {view} is not a GGUF view")
    return source


def hf_dir_for(gguf_file: Path, log: Path) -> Path:
    """The dequantized Hugging Face directory of ``gguf_file``, made the first time."""
    stat = gguf_file.stat()
    final = peers_cache() / "hf" / f"{gguf_file.stem}-{stat.st_size}-{stat.st_mtime_ns}"

    def build(tmp: Path) -> dict[str, Any]:
        print(f"dequantizing {gguf_file.name} into {final} (once; log: {log})", flush=True)
        started = time.perf_counter()
        with open(log, "a") as out:
            subprocess.run(
                [sys.executable, str(ENGINES_DIR / "make_hf.py"), str(gguf_file), str(tmp)],
                stdout=out,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=CONVERT_TIMEOUT_S,
            )
        return {
            "gguf_file": str(gguf_file),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "seconds": round(time.perf_counter() - started, 1),
        }

    return ensure_built(final, MANIFEST, build)
