"""docs/subsystems.md names only files and folders that exist: in each list item, a path with a
slash is from the repository root, and a bare file name lives in the item's first folder."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "docs" / "subsystems.md"


def named_paths(text: str) -> list[str]:
    paths = []
    for line in text.splitlines():
        if not line.startswith("- "):
            continue
        tokens = re.findall(r"`([^`]+)`", line)
        folder = next((t for t in tokens if t.endswith("/")), "")
        for token in tokens:
            if "/" in token:
                paths.append(token)
            elif token.endswith((".py", ".c", ".md")):
                paths.append(folder + token)
    return paths


def test_every_path_the_index_names_exists():
    # continuation lines belong to the item above: join them before reading
    joined = re.sub(r"\n  (?=\S)", " ", INDEX.read_text())
    paths = named_paths(joined)
    assert len(paths) > 80
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing


def test_a_bare_name_is_read_in_its_items_folder():
    assert named_paths("- `engine/core/`: `scheduler.py`, `tiers/cpu/`\n") == [
        "engine/core/",
        "engine/core/scheduler.py",
        "tiers/cpu/",
    ]
