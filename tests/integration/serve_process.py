"""``shoal serve`` as a child process of a test: its output read by a thread, waited on by
pattern, its actors' pids read from it, and stopped (SIGTERM, then SIGKILL) with its whole
process group."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

SHOAL = [sys.executable, "-m", "shoal.deploy.cli"]
REPO = Path(__file__).resolve().parents[2]


class Server:
    """``shoal serve MODEL --port 0 FLAGS...`` (``env``: more environment variables)."""

    def __init__(self, model_dir: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        command = [*SHOAL, "serve", str(model_dir), "--port", "0", *flags]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            start_new_session=True, env={**os.environ, **(env or {})},
        )  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.findall(pattern, self.text)
            if found:
                return str(found[-1])
            time.sleep(0.05)  # paces the polling
        raise AssertionError(f"no line matching {pattern!r}; output:\n{self.text[-4000:]}")

    def pid_of(self, target: str) -> int:
        """The current pid of ``target``: an actor id, or ``nats-server``."""
        if target == "nats-server":
            return int(self.wait_for(r"nats-server (?:restarted: )?pid (\d+)", 5))
        return int(self.wait_for(rf"process {target}: running \(pid (\d+)\)", 5))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
