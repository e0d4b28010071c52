"""The demo model cache: build once under a lock, publish atomically, reuse afterwards.

The checkpoint is built in a temporary directory beside its final place and renamed into place
when complete, so a crash never leaves a half-built model where a reader would look; an exclusive
``flock`` on a lock file keeps two processes from building the same checkpoint at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from shoal.workers.demo.spec import DemoSpec, Log

DEMO_VERSION = "1"
MANIFEST = "shoal-demo.json"  # written last, inside the build directory


def default_cache_root() -> Path:
    """``$SHOAL_CACHE_DIR``, else ``$XDG_CACHE_HOME/shoal``, else ``~/.cache/shoal``."""
    if explicit := os.environ.get("SHOAL_CACHE_DIR"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "shoal"


def demo_dir_name(spec: DemoSpec) -> str:
    """``demo-v<version>`` for the default spec, with a digest of the spec otherwise."""
    if spec == DemoSpec():
        return f"demo-v{DEMO_VERSION}"
    blob = json.dumps(dataclasses.asdict(spec), sort_keys=True).encode()
    return f"demo-v{DEMO_VERSION}-{hashlib.sha256(blob).hexdigest()[:12]}"


def is_complete(model_dir: Path) -> bool:
    return (model_dir / MANIFEST).is_file()


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
    if is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f".{final.name}.lock"):
        if is_complete(final):  # another process built it while we waited
            return final
        _remove_leftovers(root, final)
        _build_into(final, spec, num_threads, log or _stderr_log)
    return final


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(root: Path, final: Path) -> None:
    """Temporary directories of crashed builds, and a final directory without its manifest."""
    for stale in root.glob(f".{final.name}.build-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():
        shutil.rmtree(final)


def _build_into(final: Path, spec: DemoSpec, num_threads: int | None, log: Log) -> None:
    import torch

    from shoal.workers.demo.train import build_demo_checkpoint

    building = Path(tempfile.mkdtemp(prefix=f".{final.name}.build-", dir=final.parent))
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads or min(4, os.cpu_count() or 1))
    started = time.monotonic()
    try:
        log(f"demo model: building {final} (once; cached afterwards)")
        final_loss = build_demo_checkpoint(building, spec, log)
        manifest = {
            "version": DEMO_VERSION,
            "spec": dataclasses.asdict(spec),
            "final_loss": final_loss,
            "build_seconds": round(time.monotonic() - started, 1),
        }
        (building / MANIFEST).write_text(json.dumps(manifest, indent=2))
        os.rename(building, final)
        log(f"demo model: ready in {manifest['build_seconds']}s at {final}")
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(previous_threads)


def _stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
