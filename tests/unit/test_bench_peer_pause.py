"""bench/peers.py's pause of the idle engines while another is timed: their process groups
stopped inside the block and continued after it, even when the block fails."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.peers_lib.engine_proc import paused


def _state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _wait_for(pid: int, wanted: str) -> str:
    deadline = time.monotonic() + 5
    while (state := _state(pid)) != wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_idle_groups_are_stopped_inside_the_block_and_continued_after():
    idle = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        with pytest.raises(RuntimeError), paused([idle.pid, 999_999_999]):  # one gone already
            assert _wait_for(idle.pid, "T") == "T"
            raise RuntimeError("the timed run failed")
        assert _wait_for(idle.pid, "S") == "S"
    finally:
        idle.kill()
        idle.wait()
