"""One engine worker process (a script of ``bench/peers_engines/`` in its engine's interpreter),
seen from the parent: started in a process group of its own with its config file, its output
sent to a log file, commands written to its stdin and replies read from a pipe of their own,
each wait bounded in time; stopped (the whole group, engine children included) even on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINES_DIR = Path(__file__).resolve().parents[1] / "peers_engines"
LOG_TAIL_LINES = 15
STOP_TIMEOUT_S = 30


class WorkerError(RuntimeError):
    """A worker failed, died or did not answer in time (the message ends with its log)."""


@dataclass(frozen=True)
class EngineSpec:
    """How to start one engine's worker: its interpreter, script and extra environment."""

    name: str
    python: str
    script: str
    env: dict[str, str] = field(default_factory=dict)


def log_tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-LOG_TAIL_LINES:])


class ReplyReader:
    """Whole lines from a pipe, with a deadline."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer = fd, b""

    def line(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no reply within {timeout_s:.0f} s")
            ready, _, _ = select.select([self.fd], [], [], min(remaining, 5.0))
            if ready:
                chunk = os.read(self.fd, 1 << 16)
                if not chunk:
                    raise EOFError("the worker exited")
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        os.close(self.fd)


class EngineProcess:
    """A started worker; ``ready`` is its first reply (load time, versions)."""

    def __init__(self, spec: EngineSpec, config: dict[str, Any], run_dir: Path, tag: str) -> None:
        self.name = spec.name
        self.log = run_dir / f"{tag}.log"
        config_file = run_dir / f"{tag}.json"
        config_file.write_text(json.dumps(config))
        read_fd, write_fd = os.pipe()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [spec.python, spec.script, str(config_file), str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                env={**os.environ, **spec.env},
                cwd=run_dir,
                start_new_session=True,
                text=True,
            )
        os.close(write_fd)
        self.replies = ReplyReader(read_fd)
        self.ready: dict[str, Any] = {}

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        self.ready = self.reply(timeout_s)
        return self.ready

    def call(self, op: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """Send one command and wait for its reply."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise WorkerError(f"{self.name}: {exc}\n{log_tail(self.log)}") from None
        return self.reply(timeout_s)

    def reply(self, timeout_s: float) -> dict[str, Any]:
        try:
            message = json.loads(self.replies.line(timeout_s))
        except (TimeoutError, EOFError, ValueError) as exc:
            status = self.proc.poll()
            why = f"{exc} (status {status})" if status is not None else str(exc)
            raise WorkerError(
                f"{self.name}: {why} (log: {self.log})\n{log_tail(self.log)}"
            ) from None
        if not message.pop("ok"):
            raise WorkerError(f"{self.name}: {message['error']} (log: {self.log})")
        return message

    def close(self) -> None:
        """Ask it to quit, then stop whatever is left of its process group."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        stop_group(self.proc)
        self.replies.close()


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """Stop ``proc`` and whatever is left of its process group: SIGTERM to ``proc`` first (a
    server shuts its own children down; hit all at once, vLLM's API server logs its engine
    core's death as an error), then SIGTERM and at last SIGKILL to the group, each step given
    ``STOP_TIMEOUT_S``. Quiet when everything is gone already."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + STOP_TIMEOUT_S
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_TIMEOUT_S)
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not group_alive(proc.pid):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_TIMEOUT_S)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def paused(pgids: Iterable[int]) -> Iterator[None]:
    """The process groups stopped (SIGSTOP) for the block and continued after it: an idle
    engine's polling threads take CPU from the one being timed (beside an idle vLLM, whose
    workers used ~1 CPU-s of a 10 s run, shoal's offline rate fell ~15% on 2 cores)."""
    stopped: list[int] = []
    try:
        for pgid in pgids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGSTOP)
                stopped.append(pgid)
        yield
    finally:
        for pgid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)
