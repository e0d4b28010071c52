"""Directories built once and shared by every process of a machine: the shoal cache root, and a
directory built under an exclusive lock in a temporary sibling, renamed into place when complete.

A manifest file written last inside the build marks a directory complete, so a crash never leaves
a half-built directory where a reader would look; an exclusive ``flock`` on a lock file keeps two
processes from building the same directory at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from shoal.config.cache_root import default_cache_root

__all__ = ["default_cache_root", "ensure_built", "is_complete"]


def is_complete(directory: Path, manifest: str) -> bool:
    return (directory / manifest).is_file()


def ensure_built(final: Path, manifest: str, build: Callable[[Path], dict[str, Any]]) -> Path:
    """``final``, building it first if it is not complete: ``build(tmp)`` fills a temporary
    directory and returns the manifest's JSON, written last before the rename."""
    if is_complete(final, manifest):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(final.parent / f".{final.name}.lock"):
        if is_complete(final, manifest):  # another process built it while we waited
            return final
        _remove_leftovers(final)
        building = Path(tempfile.mkdtemp(prefix=f".{final.name}.build-", dir=final.parent))
        try:
            content = build(building)
            (building / manifest).write_text(json.dumps(content, indent=2))
            os.rename(building, final)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
    return final


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Held by one process at a time (an flock on ``path``, created if missing)."""
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(final: Path) -> None:
    """Temporary directories of crashed builds, and a final directory without its manifest."""
    for stale in final.parent.glob(f".{final.name}.build-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():
        shutil.rmtree(final)
