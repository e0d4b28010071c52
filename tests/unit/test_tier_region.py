"""A CPU tier's region file: a new region removes what earlier incarnations of the tier left
behind (this process's, or a dead process's), never the region of another live process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shoal.bus.messages.offload import KVLayout
from shoal.tiers.cpu.region import SharedRegion, region_prefix

LAYOUT = KVLayout("tiny", 1, 4, 1, 4, "float32", 1, 1)


def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                           capture_output=True, text=True)  # fmt: skip
    return int(child.stdout)


def test_a_new_region_removes_dead_and_own_leftovers_but_not_a_live_process_region(
    tmp_path: Path,
) -> None:
    prefix = region_prefix("ns", "kv-cpu")
    live = tmp_path / f"{prefix}{os.getppid()}-aaaa.kv"  # the parent process: alive
    dead = tmp_path / f"{prefix}{_dead_pid()}-bbbb.kv"
    mine = tmp_path / f"{prefix}{os.getpid()}-cccc.kv"  # an earlier tier of this process
    odd = tmp_path / f"{prefix}unknown.kv"
    for path in (live, dead, mine, odd):
        path.write_bytes(b"left behind")
    region = SharedRegion.create("ns", "kv-cpu", f"{os.getpid()}-dddd", 2, LAYOUT, tmp_path)
    try:
        assert live.exists()
        assert not dead.exists() and not mine.exists() and not odd.exists()
        assert Path(region.ref.path).stat().st_size == 2 * LAYOUT.slot_bytes
    finally:
        region.close(unlink=True)
