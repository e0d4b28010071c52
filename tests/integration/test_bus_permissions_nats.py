"""Least privilege on a real nats-server started with ``bus.nats_ops.permissions``' config: each
role connects as its own user and a whole deployment (tiers with the object store, worker, engine
core, recovery controller, gateway, a NATS API caller) serves a greedy request of the tiny
model, with no refusal; a forbidden publish or subscription of each role is refused by the
server, seen in the refused bus's ``permission_violations`` and by a subscriber that never gets
it while an allowed message on the same subject arrives; a wrong password is refused clearly."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from shoal.bus.jetstream.create import NotProvisionedError
from shoal.bus.jetstream.replicas import stream_replicas
from shoal.bus.msg import Msg
from shoal.bus.nats_ops.cluster import NatsCluster
from shoal.bus.nats_ops.permissions import ROLES, authorization_config, user_name
from shoal.bus.nats_ops.server import NatsServer, NatsServerNotFoundError
from shoal.bus.subjects import Subjects
from shoal.bus.transport.nats_bus import BusAuthError, NatsBus
from shoal.config.deployment import ShoalConfig
from shoal.deploy.nats_init import provision
from shoal.kv_events.stream import open_kv_events_stream
from shoal.workers.group_ports import open_port_bucket
from tests.fixtures.nats import nats_server_missing
from tests.integration.conditions import wait_for
from tests.integration.offload_hosts import OBJ_TIER
from tests.integration.offload_workload import offload_options
from tests.integration.role_buses import role_buses, role_deployment

pytestmark = [pytest.mark.timeout(240), pytest.mark.nats]
NS = "perm"
S = Subjects(NS)
MAX_TOKENS = 8
WAIT_S = 30.0


@pytest.fixture(scope="module")
def passwords() -> dict[str, str]:
    return {role: secrets.token_urlsafe(18) for role in ROLES}


@pytest.fixture(scope="module")
def auth_server(passwords: dict[str, str]) -> Iterator[NatsServer]:
    try:
        server = NatsServer(extra_config=authorization_config(NS, passwords))
    except NatsServerNotFoundError as exc:
        nats_server_missing(exc)
    with server:
        yield server


@pytest.fixture
async def connect_as(
    auth_server: NatsServer, passwords: dict[str, str]
) -> AsyncIterator[Callable[[str], Awaitable[NatsBus]]]:
    async with role_buses(auth_server.url, NS, passwords) as connect:
        yield connect


class Inbox:
    def __init__(self) -> None:
        self.got: list[bytes] = []

    async def __call__(self, msg: Msg) -> None:
        self.got.append(msg.data)


# (role, subject it may not publish, a role that may publish there, a role that may read it)
FORBIDDEN_PUBLISH = [
    ("gateway", S.control("engine", "engine-0"), "recovery", "engine"),
    ("gateway", S.worker_in("worker-0-0"), "engine", "worker"),
    ("worker", S.engine_out("client-1"), "engine", "gateway"),
    ("tier", S.engine_in("engine-0"), "gateway", "engine"),
    ("engine", S.control("engine", "engine-1"), "recovery", "engine"),
    ("recovery", S.worker_in("worker-0-0"), "engine", "worker"),
    ("supervisor", S.engine_in("engine-0"), "gateway", "engine"),
    ("client", S.engine_in("engine-0"), "gateway", "engine"),
    ("gateway", S.restart("engine", "engine-0"), "operator", "engine"),  # restarts: operator's
    ("client", S.restart("worker", "worker-0-0"), "operator", "worker"),
]


@pytest.mark.parametrize(("role", "subject", "sender", "reader"), FORBIDDEN_PUBLISH)
async def test_a_forbidden_publish_is_refused(connect_as, role, subject, sender, reader):  # type: ignore[no-untyped-def]
    bad, good, observer = await connect_as(role), await connect_as(sender), await connect_as(reader)
    seen = Inbox()
    await observer.subscribe(subject, seen)
    await observer.flush()
    await bad.publish(subject, b"forbidden")
    await bad.flush()
    await wait_for(lambda: bad.num_permission_violations == 1, WAIT_S, "refusal")
    assert "publish" in bad.permission_violations[-1] and subject in bad.permission_violations[-1]
    await good.publish(subject, b"allowed")
    await wait_for(lambda: seen.got, WAIT_S, "the allowed message")
    assert seen.got == [b"allowed"]
    assert bad.is_connected and good.num_permission_violations == 0


# (role, subject it may not read, a role that may publish there, a role that may read it)
FORBIDDEN_SUBSCRIBE = [
    ("tier", S.engine_in("engine-0"), "gateway", "engine"),
    ("tier", S.control("engine", "engine-0"), "recovery", "engine"),
    ("gateway", S.worker_in("worker-0-0"), "engine", "worker"),
    ("worker", S.engine_out("client-1"), "engine", "gateway"),
    ("worker", S.restart("engine", "engine-0"), "operator", "engine"),
]


@pytest.mark.parametrize(("role", "subject", "sender", "reader"), FORBIDDEN_SUBSCRIBE)
async def test_a_forbidden_subscription_is_refused(connect_as, role, subject, sender, reader):  # type: ignore[no-untyped-def]
    spy, good, observer = await connect_as(role), await connect_as(sender), await connect_as(reader)
    spied, seen = Inbox(), Inbox()
    await spy.subscribe(subject, spied)
    await spy.flush()
    await wait_for(lambda: spy.num_permission_violations == 1, WAIT_S, "refusal")
    assert "subscription" in spy.permission_violations[-1]
    await observer.subscribe(subject, seen)
    await observer.flush()
    await good.publish(subject, b"allowed")
    await wait_for(lambda: seen.got, WAIT_S, "the allowed message")
    await spy.flush()
    assert spied.got == []


async def test_replies_of_another_user_cannot_be_read(connect_as):  # type: ignore[no-untyped-def]
    spy = await connect_as("gateway")
    await spy.subscribe(S.inbox_prefix(user_name(NS, "engine")) + ".>", Inbox())
    await spy.flush()
    await wait_for(lambda: spy.num_permission_violations == 1, WAIT_S, "refusal")


async def test_a_wrong_password_is_refused_clearly(auth_server: NatsServer):
    bus = NatsBus([auth_server.url], user=user_name(NS, "worker"), password="wrong")
    refused = r"refused the credentials \(user 'perm-worker'\)"
    with pytest.raises(BusAuthError, match=refused) as err:
        await bus.connect()
    assert "wrong" not in str(err.value)


async def test_buckets_work_with_the_roles_users(connect_as):  # type: ignore[no-untyped-def]
    await provision(await connect_as("provisioner"), NS)
    worker, tier = await connect_as("worker"), await connect_as("tier")
    ports = await worker.open_kv(S.group_ports_bucket(), ttl_s=60)
    await ports.put("epoch-1", b"tcp://h:1")
    await ports.put("epoch-2", b"tcp://h:2", ttl_s=5)
    assert await ports.get("epoch-1") == b"tcp://h:1"
    async for entry in ports.watch():
        assert entry.key == "epoch-1"
        break
    await ports.delete("epoch-1")
    objects = await tier.open_object_store(S.object_bucket())
    await objects.put("chunk-1", b"x" * 300_000, writer="t")
    assert await objects.get("chunk-1") == b"x" * 300_000
    assert [e.name for e in await objects.list()] == ["chunk-1"]
    assert await objects.delete("chunk-1")
    await worker.flush()
    await tier.flush()
    assert (
        worker.permission_violations
        == tier.permission_violations
        == type(worker.permission_violations)()
    )
    gateway = await connect_as("gateway")  # no bucket of its own
    with pytest.raises(Exception):  # noqa: B017 - nats-py's own timeout/permission errors
        await gateway.open_kv(S.group_ports_bucket())
    assert gateway.num_permission_violations >= 1


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return tiny_checkpoint("llama")


async def test_a_deployment_serves_with_one_user_per_role(connect_as, model_dir, hf_reference):  # type: ignore[no-untyped-def]
    config = ShoalConfig.from_options(
        model=str(model_dir),
        dtype="float32",
        namespace=NS,
        num_gpu_blocks_override=64,
        block_size=16,
        enable_fault_tolerance=True,
        **offload_options(secondary_tiers=[OBJ_TIER]),
    )
    async with role_deployment(connect_as, config, WAIT_S * 2) as deployed:
        assert set(deployed.buses) == {"tier", "worker", "engine", "recovery", "gateway"}
        caller = deployed.buses["client"] = await connect_as("client")
        prompt = [5, 17, 42, 99, 7, 3, 250, 31]
        request = {
            "prompt_token_ids": prompt,
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        }
        reply = await caller.request(
            S.api_generate(), json.dumps(request).encode(), timeout=WAIT_S * 2
        )
        answer = json.loads(reply.data)
        assert answer["type"] == "result", answer
        expected = hf_reference(model_dir, [prompt], MAX_TOKENS)[0]
        assert answer["choices"][0]["token_ids"] == expected
        recovery = next(a for a in deployed.actors if a.kind == "recovery")
        await wait_for(lambda: recovery.policy.engines, WAIT_S, "recovery sees the engine")
    assert deployed.violations() == {}


# What each actor role opens: none may create it (whoever creates a stream picks its subjects).
OPENERS: list[tuple[str, Callable[[NatsBus], Awaitable[object]]]] = [
    ("worker", lambda bus: open_port_bucket(bus, S.group_ports_bucket())),
    ("worker", lambda bus: bus.open_object_store(S.lora_bucket())),
    ("tier", lambda bus: bus.open_object_store(S.object_bucket())),
    ("engine", lambda bus: open_kv_events_stream(bus, S)),
    ("gateway", lambda bus: open_kv_events_stream(bus, S)),
    ("gateway", lambda bus: bus.open_object_store(S.lora_bucket())),
    ("gateway", lambda bus: bus.open_kv(S.responses_bucket())),
]
# What nats-init provisions: the group-ports and stored-responses buckets, the KV tier's and
# the adapters' object buckets, the KV-events stream.
NUM_PROVISIONED = 5


async def test_only_the_provisioner_creates_buckets_through_shoal_nats_init(
    passwords: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shoal.deploy.cli import build_parser
    from shoal.deploy.nats_init import run_nats_init

    with NatsServer(extra_config=authorization_config(NS, passwords)) as server:  # nothing yet

        async def connect(role: str) -> NatsBus:
            bus = NatsBus([server.url], user=user_name(NS, role), password=passwords[role])
            await bus.connect()
            return bus

        for role, open_it in OPENERS:
            bus = await connect(role)
            with pytest.raises(NotProvisionedError, match="shoal nats-init"):
                await open_it(bus)
            assert bus.num_permission_violations == 1, role
            await bus.close()
        monkeypatch.setenv("SHOAL_NATS_USER", user_name(NS, "provisioner"))
        monkeypatch.setenv("SHOAL_NATS_PASSWORD", passwords["provisioner"])
        argv = ["nats-init", "--nats-url", server.url, "--namespace", NS]
        for _ in range(2):  # idempotent
            assert await run_nats_init(build_parser().parse_args(argv)) == 0
            assert capsys.readouterr().out.count("ready: ") == NUM_PROVISIONED
        for role, open_it in OPENERS:
            bus = await connect(role)
            await open_it(bus)
            await bus.flush()
            assert bus.num_permission_violations == 0, (role, list(bus.permission_violations))
            await bus.close()
        monkeypatch.setenv("SHOAL_NATS_USER", user_name(NS, "tier"))
        monkeypatch.setenv("SHOAL_NATS_PASSWORD", passwords["tier"])
        assert await run_nats_init(build_parser().parse_args(argv)) == 1  # not its job
        assert "may not use key-value bucket" in capsys.readouterr().err


async def test_shoal_nats_auth_prints_a_config_nats_server_accepts(tmp_path: Path, capsys):  # type: ignore[no-untyped-def]
    """The users it prints, and the route credentials it writes with ``--cluster-auth-file``
    (0600, the route password kept and reused), included inside a ``cluster {}`` block."""
    from shoal.bus.nats_ops.cluster import cluster_block, free_port
    from shoal.bus.nats_ops.credentials import resolve_credentials
    from shoal.deploy.cli import main

    try:
        server = NatsServer()
    except NatsServerNotFoundError as exc:
        nats_server_missing(exc)
    folder, cluster_file = tmp_path / "creds", server.work_dir / "cluster-auth.conf"
    route = f"127.0.0.1:{free_port()}"
    argv = ["nats-auth", "--namespace", "prod.x", "--credentials-dir", str(folder)]
    argv += ["--cluster-auth-file", str(cluster_file), "--routes", route]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    routes = cluster_file.read_text()
    password = (folder / "route.password").read_text().strip()
    assert f"nats-route://prod-x-route:{password}@{route}" in routes and password not in printed
    assert 'authorization { user: "prod-x-route"' in routes
    assert cluster_file.stat().st_mode & 0o777 == 0o600
    assert main(argv) == 0 and cluster_file.read_text() == routes  # the same password again
    server.extra_config = f"server_name: s\n{printed}"
    server.extra_config += cluster_block("c", route, "include ./cluster-auth.conf")
    with server:
        credentials = resolve_credentials("prod-x-tier", folder / "tier.password", environ={})
        assert credentials is not None
        bus = NatsBus([server.url], **credentials.bus_options())
        await bus.connect()
        await bus.publish(Subjects("prod.x").tier_peers(), b"hello")
        await bus.publish(Subjects("prod.x").engine_in("engine-0"), b"no")
        await bus.flush()
        await wait_for(lambda: bus.num_permission_violations == 1, WAIT_S, "refusal")
        await bus.close()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv[:5], "--routes", route])  # routes without the file to write them to
    assert "--routes goes with --cluster-auth-file" in capsys.readouterr().err


def test_credentials_in_the_url_are_refused(capsys):  # type: ignore[no-untyped-def]
    from shoal.deploy.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["actor", "worker", "/nowhere", "--nats-url", "nats://u:pw@127.0.0.1:4222"])
    assert exit_.value.code == 2
    assert "credentials in a NATS URL would show on the command line" in capsys.readouterr().err


async def test_a_supervised_child_gets_its_credentials_by_environment():
    """The child connects with the credentials given in its env; its command line has none."""
    from shoal.bus.nats_ops.credentials import NatsCredentials
    from shoal.bus.runtime.supervisor import ActorSpec, Supervisor
    from tests.actors.test_bus_faults import ECHO_SUBJECT, echo_spec, ping_until_answered

    credentials = NatsCredentials("u", secrets.token_urlsafe(12))
    users = f'authorization {{ users = [ {{ user: "u", password: "{credentials.password}" }} ] }}'
    try:
        server = NatsServer(extra_config=users)
    except NatsServerNotFoundError as exc:
        nats_server_missing(exc)
    with server:
        base = echo_spec(server.url)
        spec = ActorSpec(
            base.name, base.target, base.bus_url, base.kwargs, env=credentials.child_env()
        )
        client = NatsBus([server.url], **credentials.bus_options())
        await client.connect()
        try:
            async with Supervisor([spec], grace_s=3) as supervisor:
                pong = await ping_until_answered(client, ECHO_SUBJECT, limit_s=WAIT_S)
                assert pong.pid == supervisor.pid(base.name)
                cmdline = Path(f"/proc/{pong.pid}/cmdline").read_bytes()
                assert credentials.password.encode() not in cmdline
        finally:
            await client.close()


async def test_nats_init_brings_replicas_to_the_deployments_on_a_cluster(
    passwords: dict[str, str],
) -> None:
    """A deployment moved onto a cluster: its buckets made with one copy get three when the
    provisioner runs again (only it may update a stream), and a role still uses them."""
    try:
        cluster = NatsCluster(extra_config=authorization_config(NS, passwords))
    except NatsServerNotFoundError as exc:
        nats_server_missing(exc)
    with cluster:
        provisioner = NatsBus(
            [cluster.urls[0]], user=user_name(NS, "provisioner"), password=passwords["provisioner"]
        )
        await provisioner.connect()
        first = await provision(provisioner, NS, replicas=1)
        assert all(line.endswith(", 1 replica(s)") for line in first), first
        moved = await provision(provisioner, NS, replicas=3)
        assert all(line.endswith(", 3 replica(s) (was 1)") for line in moved), moved
        for stream in (f"KV_{S.group_ports_bucket()}", f"OBJ_{S.object_bucket()}"):
            assert await stream_replicas(provisioner, stream) == 3
        assert all(
            line.endswith(", 3 replica(s)") for line in await provision(provisioner, NS, replicas=3)
        )
        assert provisioner.num_permission_violations == 0, list(provisioner.permission_violations)
        await provisioner.close()
        worker = NatsBus(
            [cluster.urls[2]], user=user_name(NS, "worker"), password=passwords["worker"]
        )
        await worker.connect()
        ports = await open_port_bucket(worker, S.group_ports_bucket(), replicas=3)
        await ports.put("epoch-1", b"tcp://h:1")
        assert await ports.get("epoch-1") == b"tcp://h:1"
        assert worker.num_permission_violations == 0, list(worker.permission_violations)
        await worker.close()
