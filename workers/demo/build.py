"""The demo model cache: built once (``built_dir``: under a lock, published atomically), reused
afterwards."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from shoal.workers.built_dir import default_cache_root, ensure_built
from shoal.workers.built_dir import is_complete as _has_manifest
from shoal.workers.demo.spec import DemoSpec, Log

DEMO_VERSION = "1"
MANIFEST = "shoal-demo.json"  # written last, inside the build directory

__all__ = ["DEMO_VERSION", "default_cache_root", "ensure_demo_model", "is_complete"]


def demo_dir_name(spec: DemoSpec) -> str:
    """``demo-v<version>`` for the default spec, with a digest of the spec otherwise."""
    if spec == DemoSpec():
        return f"demo-v{DEMO_VERSION}"
    blob = json.dumps(dataclasses.asdict(spec), sort_keys=True).encode()
    return f"demo-v{DEMO_VERSION}-{hashlib.sha256(blob).hexdigest()[:12]}"


def is_complete(model_dir: Path) -> bool:
    return _has_manifest(model_dir, MANIFEST)


def ensure_demo_model(
    cache_dir: str | Path | None = None,
    *,
    spec: DemoSpec | None = None,
    num_threads: int | None = None,
    log: Log | None = None,
) -> Path:
    """The demo checkpoint's directory, building it first if the cache does not hold it yet."""
    spec = spec or DemoSpec()
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final = root / demo_dir_name(spec)
    say = log or _stderr_log
    return ensure_built(
        final, MANIFEST, lambda building: _build_into(building, final, spec, num_threads, say)
    )


def _build_into(
    building: Path, final: Path, spec: DemoSpec, num_threads: int | None, log: Log
) -> dict[str, object]:
    import torch

    from shoal.workers.demo.train import build_demo_checkpoint

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads or min(4, os.cpu_count() or 1))
    started = time.monotonic()
    try:
        log(f"demo model: building {final} (once; cached afterwards)")
        final_loss = build_demo_checkpoint(building, spec, log)
    finally:
        torch.set_num_threads(previous_threads)
    seconds = round(time.monotonic() - started, 1)
    log(f"demo model: ready in {seconds}s at {final}")
    return {
        "version": DEMO_VERSION,
        "spec": dataclasses.asdict(spec),
        "final_loss": final_loss,
        "build_seconds": seconds,
    }


def _stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
