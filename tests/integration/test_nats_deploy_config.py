"""``deploy/nats/``: the committed configs are what ``deploy.nats_config`` renders, nats-server
accepts each (``-t``) with the users and the route credentials ``shoal nats-auth`` writes beside
them, and three real nodes started from them (their ports and store dir rewritten to free
loopback ones, the routes generated for those ports) form one cluster whose JetStream elects a
meta leader. A rogue node routing to them without the route password, or with a wrong one, is
refused: it never sees a message published on the cluster, which a node given the password
does."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

import pytest

from shoal.bus.msg import Msg
from shoal.bus.nats_ops.cluster import cluster_block, free_port, free_ports, healthz, route_auth
from shoal.bus.nats_ops.server import NatsServer, NatsServerNotFoundError, find_nats_server
from shoal.bus.subjects import Subjects
from shoal.bus.transport.nats_bus import NatsBus
from shoal.deploy import nats_config
from shoal.deploy.nats_auth import (
    cluster_auth_config,
    nats_auth_config,
    route_user,
    write_private,
)
from tests.fixtures.nats import nats_server_missing
from tests.unit.deploy_manifests import K8S_DIR, load_yaml_documents

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(120)]
READY_S = 30.0
PORT_TRIES = 3
REFUSED_S = 4.0  # a refused route is tried again every second: several tries refused
JOINED_S = 20.0
SUBJECT = Subjects("shoal").tier_peers()  # one the tier's user may publish on


@pytest.fixture
def binary() -> str:
    try:
        return find_nats_server()
    except NatsServerNotFoundError as exc:
        nats_server_missing(exc)


def test_the_committed_configs_are_the_rendered_ones() -> None:
    committed = {p.name: p.read_text() for p in nats_config.CONFIG_DIR.glob("*.conf")}
    assert committed == nats_config.config_files()


def _with_users(directory: Path, routes: list[str] | None = None) -> Path:
    """``auth.conf`` and ``cluster-auth.conf`` in ``directory``, as an operator makes them
    (``shoal nats-auth --cluster-auth-file``); returns the credentials dir."""
    credentials = directory / "credentials"
    (directory / nats_config.AUTH_FILE).write_text(nats_auth_config("shoal", credentials))
    cluster = cluster_auth_config("shoal", credentials, routes or nats_config.route_hosts())
    write_private(directory / nats_config.CLUSTER_AUTH_FILE, cluster)
    return credentials


def _configs() -> dict[str, str]:
    """deploy/nats's node configs and Kubernetes' (ConfigMap nats-config), by file name."""
    (config_map, *_) = load_yaml_documents(K8S_DIR / "nats.yaml")
    configs = {p.name: p.read_text() for p in sorted(nats_config.CONFIG_DIR.glob("*.conf"))}
    return configs | {"k8s.conf": config_map["data"]["nats.conf"]}


def test_nats_server_accepts_each_config(binary: str, tmp_path: Path) -> None:
    _with_users(tmp_path)
    for name, text in _configs().items():
        (tmp_path / name).write_text(text)
        check = [binary, "-t", "-c", str(tmp_path / name)]
        env = {**os.environ, "POD_NAME": "nats-0"}  # Kubernetes' server_name
        done = subprocess.run(check, capture_output=True, timeout=30, env=env)
        assert done.returncode == 0, (name, done.stderr.decode())


def _on_loopback(text: str, index: int, ports: list[dict[str, int]], store: Path) -> str:
    mine = ports[index]
    text = text.replace(f"0.0.0.0:{nats_config.CLIENT_PORT}", f"127.0.0.1:{mine['client']}")
    text = text.replace(f"0.0.0.0:{nats_config.CLUSTER_PORT}", f"127.0.0.1:{mine['cluster']}")
    text = text.replace(f"0.0.0.0:{nats_config.MONITOR_PORT}", f"127.0.0.1:{mine['http']}")
    return text.replace(nats_config.STORE_DIR, str(store))


@contextmanager
def _deployed_cluster(binary: str, tmp_path: Path) -> Iterator[tuple[list[dict[str, int]], Path]]:
    """The three committed configs running on loopback with generated credentials, JetStream
    ready on each; yields each node's ports and the credentials folder. Ports are picked free,
    then bound by the nodes: a port another process took meanwhile makes a node exit, and the
    cluster starts again on new ones (at most ``PORT_TRIES`` times)."""
    for attempt in range(PORT_TRIES):
        procs: list[subprocess.Popen[bytes]] = []
        folder = tmp_path / f"try-{attempt}"
        try:
            ports = _start_nodes(binary, folder, procs)
        except _PortTaken:
            continue
        else:
            yield ports, folder / "credentials"
            return
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(10)
    raise AssertionError(f"no free ports for the cluster in {PORT_TRIES} tries")


class _PortTaken(Exception):
    pass


def _start_nodes(
    binary: str, folder: Path, procs: list[subprocess.Popen[bytes]]
) -> list[dict[str, int]]:
    folder.mkdir()
    picked = iter(free_ports(9))
    ports = [{kind: next(picked) for kind in ("client", "cluster", "http")} for _ in range(3)]
    _with_users(folder, [f"127.0.0.1:{p['cluster']}" for p in ports])
    logs = [folder / f"node-{i}.log" for i in range(3)]
    for i in range(3):
        text = (nats_config.CONFIG_DIR / f"{nats_config.node_name(i)}.conf").read_text()
        config = folder / f"node-{i}.conf"
        config.write_text(_on_loopback(text, i, ports, folder / f"store-{i}"))
        with logs[i].open("wb") as log:
            procs.append(subprocess.Popen([binary, "-c", str(config)], stdout=log, stderr=log))
    deadline = time.monotonic() + READY_S
    status = [""] * 3
    while status != ["ok"] * 3 and time.monotonic() < deadline:
        if not all(p.poll() is None for p in procs):
            texts = [log.read_text() for log in logs]
            if any("address already in use" in text for text in texts):
                raise _PortTaken
            raise AssertionError(f"a node exited: {texts}")
        status = [healthz(p["http"]) for p in ports]
        time.sleep(0.05)  # paces the polling
    assert status == ["ok"] * 3, [log.read_text() for log in logs]
    assert all(f"nats-{i}" in logs[i].read_text() for i in range(3))
    return ports


def test_three_nodes_from_the_configs_form_a_cluster(binary: str, tmp_path: Path) -> None:
    with _deployed_cluster(binary, tmp_path):
        pass


def _outsider(binary: str, name: str, routes: str) -> NatsServer:
    """A node of cluster "shoal" of its own (no users, no JetStream), routing as ``routes``."""
    config = f'server_name: "{name}"\n'
    config += cluster_block("shoal", f"127.0.0.1:{free_port()}", routes)
    return NatsServer(jetstream=False, binary=binary, extra_config=config)


async def _listen(stack: AsyncExitStack, binary: str, name: str, routes: str) -> list[bytes]:
    """Start an outsider node and listen on it: what it hears (until ``stack`` closes)."""
    heard: list[bytes] = []

    async def hear(msg: Msg) -> None:
        heard.append(msg.data)

    server = stack.enter_context(_outsider(binary, name, routes))
    bus = NatsBus([server.url], name=name)
    await bus.connect()
    stack.push_async_callback(bus.close)
    await bus.subscribe(SUBJECT, hear)
    await bus.flush()
    return heard


async def _publish_until(bus: NatsBus, heard: list[list[bytes]], seconds: float) -> None:
    """Publish on the cluster every 0.1 s until every listener heard something, or ``seconds``."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not all(heard) and asyncio.get_running_loop().time() < deadline:
        await bus.publish(SUBJECT, b"cluster traffic")
        await asyncio.sleep(0.1)  # paces the publishing


async def test_a_node_without_the_route_password_is_refused(binary: str, tmp_path: Path) -> None:
    with _deployed_cluster(binary, tmp_path) as (ports, credentials):
        routes = [f"127.0.0.1:{p['cluster']}" for p in ports]
        user, password = route_user("shoal"), (credentials / "route.password").read_text().strip()
        tier_password = (credentials / "tier.password").read_text().strip()
        async with AsyncExitStack() as stack:
            url = f"nats://127.0.0.1:{ports[1]['client']}"
            publisher = NatsBus([url], user="shoal-tier", password=tier_password)
            await publisher.connect()
            stack.push_async_callback(publisher.close)
            refused = [
                await _listen(stack, binary, "no-password", route_auth(routes[:1])),
                await _listen(stack, binary, "wrong-password", route_auth(routes[2:], user, "x")),
            ]
            await _publish_until(publisher, refused, REFUSED_S)
            assert refused == [[], []]
            # The control: a node given the password joins and hears the cluster's traffic.
            joined = await _listen(
                stack, binary, "with-password", route_auth(routes, user, password)
            )
            await _publish_until(publisher, [joined], JOINED_S)
            assert joined, "a node with the route password never heard the cluster"
            assert refused == [[], []]
