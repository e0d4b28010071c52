"""Where shoal keeps what it builds or fetches once per machine (every process agrees)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_root() -> Path:
    """``$SHOAL_CACHE_DIR``, else ``$XDG_CACHE_HOME/shoal``, else ``~/.cache/shoal``."""
    if explicit := os.environ.get("SHOAL_CACHE_DIR"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "shoal"
