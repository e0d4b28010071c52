"""``deploy/nats/``: the committed configs are what ``deploy.nats_config`` renders, nats-server
accepts each (``-t``) with the users ``shoal nats-auth`` writes beside them, and three real
nodes started from them (their ports, host names and store dir rewritten to free loopback ones)
form one cluster whose JetStream elects a meta leader."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from shoal.bus.nats_cluster import free_port, healthz
from shoal.bus.server import NatsServerNotFoundError, find_nats_server
from shoal.deploy import nats_config
from shoal.deploy.nats_auth import nats_auth_config

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(120)]
READY_S = 30.0


@pytest.fixture
def binary() -> str:
    try:
        return find_nats_server()
    except NatsServerNotFoundError as exc:
        pytest.skip(str(exc))


def test_the_committed_configs_are_the_rendered_ones() -> None:
    committed = {p.name: p.read_text() for p in nats_config.CONFIG_DIR.glob("*.conf")}
    assert committed == nats_config.config_files()


def _with_users(directory: Path) -> None:
    """``auth.conf`` in ``directory``, as an operator makes it (``shoal nats-auth``)."""
    config = nats_auth_config("shoal", directory / "credentials")
    (directory / nats_config.AUTH_FILE).write_text(config)


def test_nats_server_accepts_each_config(binary: str, tmp_path: Path) -> None:
    _with_users(tmp_path)
    for path in sorted(nats_config.CONFIG_DIR.glob("*.conf")):
        (tmp_path / path.name).write_text(path.read_text())
        check = [binary, "-t", "-c", str(tmp_path / path.name)]
        done = subprocess.run(check, capture_output=True, timeout=30)
        assert done.returncode == 0, done.stderr.decode()


def _on_loopback(text: str, index: int, ports: list[dict[str, int]], store: Path) -> str:
    mine = ports[index]
    text = text.replace(f"0.0.0.0:{nats_config.CLIENT_PORT}", f"127.0.0.1:{mine['client']}")
    text = text.replace(f"0.0.0.0:{nats_config.CLUSTER_PORT}", f"127.0.0.1:{mine['cluster']}")
    text = text.replace(f"0.0.0.0:{nats_config.MONITOR_PORT}", f"127.0.0.1:{mine['http']}")
    for i, theirs in enumerate(ports):
        name = nats_config.node_name(i)
        text = text.replace(f"{name}:{nats_config.CLUSTER_PORT}", f"127.0.0.1:{theirs['cluster']}")
    return text.replace(nats_config.STORE_DIR, str(store))


def test_three_nodes_from_the_configs_form_a_cluster(binary: str, tmp_path: Path) -> None:
    ports = [{kind: free_port() for kind in ("client", "cluster", "http")} for _ in range(3)]
    procs: list[subprocess.Popen[bytes]] = []
    _with_users(tmp_path)
    try:
        for i in range(3):
            text = (nats_config.CONFIG_DIR / f"{nats_config.node_name(i)}.conf").read_text()
            config = tmp_path / f"node-{i}.conf"
            config.write_text(_on_loopback(text, i, ports, tmp_path / f"store-{i}"))
            log = (tmp_path / f"node-{i}.log").open("wb")
            procs.append(subprocess.Popen([binary, "-c", str(config)], stdout=log, stderr=log))
        deadline = time.monotonic() + READY_S
        status = [""] * 3
        while status != ["ok"] * 3 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a node exited"
            status = [healthz(p["http"]) for p in ports]
            time.sleep(0.05)  # paces the polling
        assert status == ["ok"] * 3, [(tmp_path / f"node-{i}.log").read_text() for i in range(3)]
        assert all(f"nats-{i}" in (tmp_path / f"node-{i}.log").read_text() for i in range(3))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
