"""The run's journal: every figure appended, as it is measured, as one JSON line to
``journal.jsonl`` in the run folder, so a run cut short (the machine is shared: runs stopped
from outside have been seen) still leaves what it measured."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

JOURNAL = "journal.jsonl"


def journal(run_dir: Path, **entry: Any) -> None:
    """Append ``entry`` (with the wall-clock time) to the run folder's journal."""
    with open(run_dir / JOURNAL, "a") as out:
        out.write(json.dumps({"time": time.strftime("%H:%M:%S"), **entry}) + "\n")
