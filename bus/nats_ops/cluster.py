"""A NATS cluster: the config block that joins nats-server nodes into one cluster (also what
``deploy/nats/`` is rendered from), and ``NatsCluster``, a launcher of N clustered nodes on
loopback for tests and single-host trials.

Each node of a ``NatsCluster`` is a ``bus.nats_ops.server.NatsServer`` with its own client port,
a cluster port routed to every other node's (as ``route_user`` with a random ``route_password``:
a node without it is refused) and a monitoring port (every node's ports picked at once, all
distinct), a unique ``server_name`` and its own JetStream store dir; all share one cluster
name. ``start`` returns once every node's JetStream is in contact with an elected meta leader
(``/healthz`` answers ok), so a bucket or stream can be created at once. One node can be
stopped, killed and started again (same ports, same store dir) while the others go on.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

from shoal.bus.nats_ops.server import DEFAULT_MAX_PAYLOAD, NatsServer, NatsServerError

DEFAULT_CLUSTER_NAME = "shoal"


def route_auth(routes: list[str], user: str | None = None, password: str | None = None) -> str:
    """The route part of a ``cluster {}`` block: ``authorization { user, password }`` (what a
    node asks of a node routing to it; none: no check) and every node's route URL, credentials
    in it (its own among them is fine: a node ignores a route to itself). ``deploy.nats_auth``
    writes this to a file of its own, the secret part of a node's config."""
    if (user is None) != (password is None):
        raise ValueError("route authorization needs both a user and a password")
    auth, creds = "", ""
    if user is not None:
        auth = f"authorization {{ user: {json.dumps(user)}, password: {json.dumps(password)} }}\n"
        creds = f"{quote(user, safe='')}:{quote(str(password), safe='')}@"  # as URL userinfo
    route_lines = "".join(f"  nats-route://{creds}{route}\n" for route in routes)
    return f"{auth}routes: [\n{route_lines}]\n"


def cluster_block(name: str, listen: str, body: str) -> str:
    """The ``cluster { ... }`` block of one node: its route listener, then ``body`` (the
    ``route_auth`` text, or an ``include`` of the file holding it)."""
    lines = "".join(f"  {line}\n" for line in body.splitlines())
    return f"cluster {{\n  name: {json.dumps(name)}\n  listen: {json.dumps(listen)}\n{lines}}}\n"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's pick)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports free on ``host`` now: all are held bound until every one is
    picked, so the OS cannot hand the same port out twice (as picking them one at a time can)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def healthz(monitor_port: int, timeout: float = 1.0) -> str:
    """A node's ``/healthz`` status ("ok" once its JetStream follows a meta leader), or the
    error it answered with."""
    url = f"http://127.0.0.1:{monitor_port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            body = json.loads(reply.read())
    except urllib.error.HTTPError as exc:  # 503 while JetStream has no meta leader
        body = json.loads(exc.read() or b"{}")
    except (OSError, ValueError) as exc:
        return f"unreachable: {exc}"
    return str(body.get("status") if body.get("status") == "ok" else body.get("error", body))


class NatsCluster:
    """``num_nodes`` clustered nats-servers on 127.0.0.1. Use as a context manager or
    start/cleanup; ``urls`` are the nodes' client URLs (``url``: comma-joined)."""

    def __init__(
        self,
        num_nodes: int = 3,
        *,
        cluster_name: str = DEFAULT_CLUSTER_NAME,
        jetstream: bool = True,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        ready_timeout: float = 30.0,
        binary: str | None = None,
        extra_config: str = "",
    ) -> None:
        """``extra_config``: more of every node's config (an ``authorization`` block, say)."""
        if num_nodes < 1:
            raise ValueError(f"a cluster needs at least one node, got {num_nodes}")
        self.cluster_name = cluster_name
        self.jetstream = jetstream
        self.ready_timeout = ready_timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="shoal-nats-cluster-")
        # Every port is picked up front, all distinct: a node left to pick its own (``-1``)
        # could be handed a later node's cluster port, released but not yet listened on.
        ports = free_ports(3 * num_nodes)
        client_ports = ports[:num_nodes]
        self.cluster_ports = ports[num_nodes : 2 * num_nodes]
        self.monitor_ports = ports[2 * num_nodes :]
        self.route_user = f"{cluster_name}-route"
        self.route_password = secrets.token_urlsafe(18)
        routes = [f"127.0.0.1:{port}" for port in self.cluster_ports]
        self.nodes = [
            NatsServer(
                port=client_ports[i],
                store_dir=str(Path(self._tmp.name) / f"node-{i}"),
                jetstream=jetstream,
                max_payload=max_payload,
                binary=binary,
                extra_config=self._node_config(i, routes) + extra_config,
            )
            for i in range(num_nodes)
        ]

    def _node_config(self, index: int, routes: list[str]) -> str:
        return (
            f"server_name: {json.dumps(self.server_name(index))}\n"
            f'http: "127.0.0.1:{self.monitor_ports[index]}"\n'
            + cluster_block(
                self.cluster_name,
                f"127.0.0.1:{self.cluster_ports[index]}",
                route_auth(routes, self.route_user, self.route_password),
            )
        )

    def server_name(self, index: int) -> str:
        return f"{self.cluster_name}-{index}"

    @property
    def server_names(self) -> list[str]:
        """Each node's ``server_name`` (as JetStream names a stream's leader and replicas)."""
        return [self.server_name(i) for i in range(len(self.nodes))]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-joined (as ``--nats-url`` takes them)."""
        return ",".join(self.urls)

    def start(self) -> NatsCluster:
        """Start every node not running, then wait until JetStream is ready on each."""
        try:
            for node in self.nodes:
                node.start()
            self.wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self, index: int) -> NatsServer:
        """Start node ``index`` again (same ports and store dir); returns once it is ready."""
        node = self.nodes[index].start()
        self.wait_until_ready([index])
        return node

    def stop_node(self, index: int) -> None:
        """Stop node ``index`` gracefully (SIGTERM: its clients are told to move on)."""
        self.nodes[index].stop()

    def kill_node(self, index: int) -> None:
        """SIGKILL node ``index``, as a crash of its host would."""
        self.nodes[index].kill()

    def running(self) -> list[int]:
        return [i for i, node in enumerate(self.nodes) if node.is_running]

    def wait_until_ready(self, indexes: list[int] | None = None) -> None:
        """Wait until each running node of ``indexes`` (default: all) answers ``/healthz`` ok:
        JetStream enabled and in contact with an elected meta leader (just up without
        JetStream: accepting clients is enough)."""
        if not self.jetstream:
            return
        deadline = time.monotonic() + self.ready_timeout
        waiting = [i for i in (self.running() if indexes is None else indexes)]
        last = ""
        while waiting:
            for i in list(waiting):
                port = self.nodes[i].monitor_port
                last = healthz(port) if port is not None else "no monitoring port"
                if last == "ok":
                    waiting.remove(i)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise NatsServerError(
                    f"JetStream not ready on nodes {waiting} within {self.ready_timeout}s: {last}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
        self._tmp.cleanup()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
