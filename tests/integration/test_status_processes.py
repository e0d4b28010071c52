"""``shoal status`` and ``shoal top`` against a running deployment (every actor its own process
on a real nats-server, default flags: fault tolerance on, so a recovery controller runs too):
``status --json`` lists every actor READY on this host; after the worker is SIGKILLed and its
supervisor restarts it, the worker shows a new incarnation (and one restart seen by a board
that watched) while the others keep theirs; ``top``, driven in a pseudo-terminal, draws the same
rows."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.deploy.deployment import build_config
from tests.integration.conditions import wait_for
from tests.integration.process_deployment import process_deployment

pytestmark = [pytest.mark.timeout(300), pytest.mark.nats, pytest.mark.slow]
NAMESPACE = "statusproc"
SHOAL = str(Path(sys.executable).parent / "shoal")
ACTORS = {"worker-0-0": "worker", "engine-0": "engine", "recovery-0": "recovery"}


def status(nats_url: str) -> dict[str, dict]:  # type: ignore[type-arg]
    done = subprocess.run(
        [SHOAL, "status", "--json", "--nats-url", nats_url, "--namespace", NAMESPACE],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return {actor["id"]: actor for actor in json.loads(done.stdout)["actors"]}


def top_screen(nats_url: str, seconds: float) -> str:
    """What ``shoal top`` draws in a pseudo-terminal over ``seconds``."""
    leader, follower = pty.openpty()
    command = [SHOAL, "top", "--nats-url", nats_url, "--namespace", NAMESPACE,
               "--refresh-s", "0.5", "--duration-s", str(seconds)]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "LINES": "40", "TERM": "xterm"}
    proc = subprocess.Popen(command, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    screen = b""
    deadline = time.monotonic() + seconds + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed with the process
                break
            if not chunk:
                break
            screen += chunk
        elif proc.poll() is not None:
            break
    assert proc.wait(timeout=30) == 0, screen.decode(errors="replace")[-2000:]
    os.close(leader)
    return screen.decode(errors="replace")


async def test_status_and_top_show_every_actor_and_a_restart(nats_server, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    config = build_config(
        model=str(tiny_checkpoint("llama")), namespace=NAMESPACE, dtype="float32",
        num_gpu_blocks_override=64, max_num_seqs=4, worker_dead_after_s=2.0,
    )  # fmt: skip
    assert config.fault_tolerance_config.enable_fault_tolerance  # the default
    async with process_deployment(nats_server.url, config) as deployed:
        before = await asyncio.to_thread(status, nats_server.url)
        assert {i: a["kind"] for i, a in before.items()} == ACTORS
        assert all(a["state"] == "READY" for a in before.values()), before
        assert all(a["host"] == socket.gethostname() for a in before.values())
        assert before["engine-0"]["kv_usage"] == 0.0
        assert before["worker-0-0"]["uptime_s"] > 0

        supervisor = deployed.supervisor
        pid = supervisor.pid("worker-0-0")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await wait_for(lambda: supervisor.num_restarts("worker-0-0") >= 1, 60, "a restart")
        await deployed.client.wait_until_ready(120)

        async def worker_back() -> dict[str, dict]:  # type: ignore[type-arg]
            while True:
                after = await asyncio.to_thread(status, nats_server.url)
                worker = after.get("worker-0-0", {})
                new = worker.get("incarnation") != before["worker-0-0"]["incarnation"]
                if new and worker["state"] == "READY" and after["engine-0"]["state"] == "READY":
                    return after

        after = await asyncio.wait_for(worker_back(), 120)
        assert after["engine-0"]["incarnation"] == before["engine-0"]["incarnation"]
        assert after["recovery-0"]["incarnation"] == before["recovery-0"]["incarnation"]

        screen = await asyncio.to_thread(top_screen, nats_server.url, 3.0)
        for actor_id, kind in ACTORS.items():
            assert actor_id in screen and kind in screen, screen[-3000:]
        assert "ready" in screen and "3 actors" in screen
