"""The role table of ``bus.nats_ops.permissions`` (pure): every subject method is covered, the
issue's required denials hold, no role's deny shadows what it must do, inboxes and transfers are
private, replies go out by a bounded ``allow_responses`` (no one may publish into another's inbox
but the gateway into the client's), and the credentials of an actor process never reach a command
line or a log line."""

from __future__ import annotations

import inspect
import os
import stat
from pathlib import Path

import pytest

from shoal.bus.nats_ops.credentials import (
    CredentialsError,
    NatsCredentials,
    redact_url,
    resolve_credentials,
    url_has_secret,
)
from shoal.bus.nats_ops.permissions import (
    BUCKETS,
    COMMON_PUBLISH,
    COMMON_SUBSCRIBE,
    NOT_GRANTED,
    ROLES,
    Responses,
    authorization_config,
    permissions,
    subject_matches,
    user_name,
)
from shoal.bus.runtime.supervisor import ActorSpec
from shoal.bus.subjects import Subjects
from shoal.deploy.nats_auth import nats_auth_config

S = Subjects("prod.shoal")


def _granted_methods() -> set[str]:
    grants = [*COMMON_PUBLISH, *COMMON_SUBSCRIBE]
    for role in ROLES.values():
        grants += [*role.publish, *role.subscribe, *role.deny_publish, *role.deny_subscribe]
    buckets = {bucket.method for role in ROLES.values() for bucket in role.buckets}
    return {g.method for g in grants} | buckets


def test_every_public_subjects_method_is_in_the_role_table():
    public = {
        name
        for name, member in inspect.getmembers(Subjects, inspect.isfunction)
        if not name.startswith("_")
    }
    missing = public - _granted_methods() - NOT_GRANTED.keys()
    where = "bus.nats_ops.permissions.ROLES"
    assert not missing, f"add these Subjects methods to {where}: {sorted(missing)}"
    assert NOT_GRANTED.keys() <= public  # no stale exemption
    assert not NOT_GRANTED.keys() & _granted_methods()


def test_bucket_kinds_are_known():
    assert {bucket.kind for role in ROLES.values() for bucket in role.buckets} <= BUCKETS.keys()


@pytest.mark.parametrize(
    ("role", "subject"),
    [
        ("gateway", S.control("engine", "engine-0")),  # no recovery commands
        ("gateway", S.control("worker", "worker-0-0")),
        ("gateway", S.worker_in("worker-0-0")),  # no steps
        ("gateway", S.engine_results("engine-0")),
        ("worker", S.engine_out("client-1")),  # no client outputs
        ("worker", S.engine_in("engine-0")),
        ("tier", S.engine_in("engine-0")),  # no engine inboxes
        ("tier", S.engine_results("engine-0")),
        ("tier", S.control("engine", "engine-0")),
        ("tier", S.engine_out("client-1")),
        ("recovery", S.worker_in("worker-0-0")),
        ("recovery", S.engine_in("engine-0")),
        ("engine", S.control("engine", "engine-1")),
        ("engine", S.api_generate()),
        ("client", S.engine_in("engine-0")),
        ("supervisor", S.engine_in("engine-0")),
        ("worker", S.heartbeat("engine")),  # only its own kind's heartbeat
        ("tier", S.status("engine")),
        ("gateway", S.restart("engine", "engine-0")),  # restarts: the operator's alone
        ("recovery", S.restart("worker", "worker-0-0")),
        ("client", S.restart("gateway", "gateway-0")),
        ("operator", S.engine_in("engine-0")),
        ("operator", S.control("engine", "engine-0")),
    ],
)
def test_required_publish_denials(role: str, subject: str):
    assert not permissions(S.namespace, role).may_publish(subject)


@pytest.mark.parametrize(
    ("role", "subject"),
    [
        ("tier", S.engine_in("engine-0")),
        ("tier", S.engine_results("engine-0")),
        ("tier", S.control("engine", "engine-0")),
        ("worker", S.engine_out("client-1")),
        ("gateway", S.worker_in("worker-0-0")),
        ("gateway", S.inbox_prefix(user_name(S.namespace, "engine")) + ".x"),  # private replies
        ("engine", S.api_generate()),
        ("worker", S.restart("engine", "engine-0")),  # only its own kind's restarts
    ],
)
def test_required_subscribe_denials(role: str, subject: str):
    assert not permissions(S.namespace, role).may_subscribe(subject)


@pytest.mark.parametrize(
    ("role", "publish", "subscribe"),
    [
        ("gateway", [S.engine_in("engine-3")], [S.engine_out("client-9")]),
        ("engine", [S.worker_in("w"), S.engine_out("c"), S.tier_in("kv-cpu")], [S.engine_in("e")]),
        ("worker", [S.engine_results("engine-0")], [S.worker_in("worker-0-1")]),
        ("tier", [S.tier_peers(), S.tier_in("kv-cpu")], [S.tier_peer_reads("p2p-1")]),
        ("recovery", [S.control("engine", "engine-0")], [S.heartbeat("engine")]),
        ("supervisor", [S.status("worker")], []),
        ("client", [S.api_generate(), S.api("cancel")], []),
        ("operator", [S.restart("engine", "engine-1")], [S.heartbeat("tier"), S.status("x")]),
        ("worker", [], [S.restart("worker", "worker-0-0")]),
        ("gateway", [], [S.restart("gateway", "gateway-1")]),
    ],
)
def test_what_each_role_needs_is_allowed(role: str, publish: list[str], subscribe: list[str]):
    perms = permissions(S.namespace, role)
    assert all(perms.may_publish(s) for s in publish)
    assert all(perms.may_subscribe(s) for s in subscribe)
    assert perms.may_subscribe(S.inbox_prefix(perms.user) + ".abc.1")


@pytest.mark.parametrize("role", list(ROLES))
def test_no_deny_shadows_an_allow(role: str):
    perms = permissions(S.namespace, role)
    for pattern in perms.publish:
        sample = pattern.replace("*", "x").replace(">", "x")
        assert perms.may_publish(sample), (role, pattern)
    for pattern in perms.subscribe:
        assert perms.may_subscribe(pattern.replace("*", "x").replace(">", "x")), (role, pattern)


ANSWERING = [r for r in ROLES if ROLES[r].actor] + ["client"]  # answer requests (chunk pulls too)


@pytest.mark.parametrize("role", list(ROLES))
def test_no_role_may_publish_into_another_users_inboxes(role: str):
    """Replies go out by allow_responses: a grant on ``_INBOX.>`` would let a compromised
    worker forge a reply into the gateway's or an engine core's pending request."""
    perms = permissions(S.namespace, role)
    for other in ROLES:
        inbox = S.inbox_prefix(user_name(S.namespace, other)) + ".abc.1"
        may = role == "gateway" and other == "client"  # its streamed NATS API answers
        assert perms.may_publish(inbox) is may, (role, other)
    assert not perms.may_publish("_INBOX.abc.1")  # nats-py's default prefix: any other user


@pytest.mark.parametrize("role", list(ROLES))
def test_who_answers_requests_does_so_once_each_within_a_bounded_time(role: str):
    responses = permissions(S.namespace, role).responses
    if role not in ANSWERING:
        assert responses is None
        return
    assert responses is not None and responses.max_msgs == 1
    assert 120 < responses.expires_s <= 3600  # above a step's timeout; never kept forever
    config = authorization_config(S.namespace, {role: "pw"})
    assert f'allow_responses: {{ max: 1, expires: "{responses.expires_s}s" }}' in config


def test_no_other_user_in_the_config_answers_without_a_limit():
    config = authorization_config(S.namespace, {role: "pw" for role in ROLES})
    assert config.count("allow_responses:") == len(ANSWERING)
    assert Responses(3, 5).config() == '{ max: 3, expires: "5s" }'


@pytest.mark.parametrize("role", [r for r in ROLES if r in ANSWERING])
def test_a_role_receives_only_its_own_chunk_pulls(role: str):
    """Subscribing to every transfer would show other senders' pulls (and so the transfer
    subjects to pull their payloads from)."""
    perms = permissions(S.namespace, role)
    for other in ROLES:
        pull = S.transfer_prefix(user_name(S.namespace, other)) + ".sender.transfer"
        assert perms.may_subscribe(pull) is (other == role), (role, other)
    assert not perms.may_subscribe(S.transfers())
    assert not perms.may_subscribe("_SHOAL_XFER.sender.transfer")  # no user's prefix


@pytest.mark.parametrize("role", [r for r in ROLES if ROLES[r].actor])
def test_an_actor_pulls_any_senders_transfer(role: str):
    perms = permissions(S.namespace, role)
    for sender in ROLES:
        assert perms.may_publish(S.transfer_prefix(user_name(S.namespace, sender)) + ".s.t")


def test_the_client_pulls_only_the_gateways_transfers():
    perms = permissions(S.namespace, "client")
    gateway = S.transfer_prefix(user_name(S.namespace, "gateway"))
    assert perms.may_publish(gateway + ".sender.transfer")
    for other in ("engine", "worker", "tier", "client"):
        assert not perms.may_publish(S.transfer_prefix(user_name(S.namespace, other)) + ".s.t")


def test_gateway_may_command_only_when_asked():
    command = S.control("engine", "engine-0")
    assert not permissions(S.namespace, "gateway").may_publish(command)
    assert permissions(S.namespace, "gateway", gateway_may_command=True).may_publish(command)
    assert not permissions(S.namespace, "gateway", gateway_may_command=True).may_publish(
        S.worker_in("worker-0-0")
    )


def test_buckets_granted_by_name():
    worker = permissions(S.namespace, "worker")
    assert worker.may_publish(f"$KV.{S.group_ports_bucket()}.epoch-1")
    assert worker.may_publish(f"$JS.API.STREAM.INFO.KV_{S.group_ports_bucket()}")
    assert not worker.may_publish(f"$JS.API.STREAM.INFO.OBJ_{S.object_bucket()}")
    tier = permissions(S.namespace, "tier")
    assert tier.may_publish(f"$O.{S.object_bucket()}.C.abc")
    assert not tier.may_publish(f"$JS.API.STREAM.DELETE.OBJ_{S.object_bucket()}")
    assert not tier.may_publish("$JS.API.STREAM.INFO.KV_other")
    assert tier.may_publish(f"$JS.API.STREAM.PURGE.OBJ_{S.object_bucket()}")  # evictions
    assert not worker.may_publish(f"$JS.API.STREAM.PURGE.KV_{S.group_ports_bucket()}")


# Whoever may create a stream picks its subjects (e.g. ">"), so could read any traffic.
STREAMS = [
    f"KV_{S.group_ports_bucket()}",
    f"OBJ_{S.object_bucket()}",
    S.kv_events_stream(),
]


@pytest.mark.parametrize("role", [r for r in ROLES if r != "provisioner"])
def test_no_actor_role_may_create_or_purge_a_stream_it_only_reads(role: str):
    perms = permissions(S.namespace, role)
    for stream in STREAMS:
        assert not perms.may_publish(f"$JS.API.STREAM.CREATE.{stream}"), stream
        assert not perms.may_publish(f"$JS.API.STREAM.UPDATE.{stream}"), stream
        assert not perms.may_publish(f"$JS.API.STREAM.MSG.DELETE.{stream}"), stream
        if role != "tier":
            assert not perms.may_publish(f"$JS.API.STREAM.PURGE.{stream}"), stream


def test_the_provisioner_creates_the_namespaces_streams_and_nothing_else():
    perms = permissions(S.namespace, "provisioner")
    for stream in STREAMS:
        assert perms.may_publish(f"$JS.API.STREAM.CREATE.{stream}"), stream
        assert perms.may_publish(f"$JS.API.STREAM.UPDATE.{stream}"), stream  # its replicas
    assert not perms.may_publish(f"$JS.API.STREAM.CREATE.{Subjects('other').kv_events_stream()}")
    assert not perms.may_publish("$JS.API.STREAM.CREATE.ANY")
    assert not perms.may_publish(S.engine_in("engine-0"))
    assert not perms.may_subscribe(S.engine_out("client-1"))


def test_subject_matching():
    assert subject_matches("a.*.c", "a.b.c") and not subject_matches("a.*.c", "a.b.c.d")
    assert subject_matches("a.>", "a.b.c") and not subject_matches("a.>", "a")


def test_credentials_from_env_and_file(tmp_path: Path):
    env = {"SHOAL_NATS_USER": "u", "SHOAL_NATS_PASSWORD": "p"}
    assert resolve_credentials(environ=env) == NatsCredentials("u", "p")
    assert resolve_credentials(environ={}) is None
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    assert resolve_credentials("v", secret, environ=env) == NatsCredentials("v", "from-file")
    with pytest.raises(CredentialsError, match="needs a password"):
        resolve_credentials("u", environ={})
    with pytest.raises(CredentialsError, match="needs a user"):
        resolve_credentials(environ={"SHOAL_NATS_PASSWORD": "p"})
    with pytest.raises(CredentialsError, match="cannot read"):
        resolve_credentials("u", tmp_path / "missing", environ={})
    assert "from-file" not in repr(NatsCredentials("v", "from-file"))


def test_urls_are_redacted():
    assert (
        redact_url("nats://u:s3cret@h:4222,nats://h2:4222") == "nats://u:***@h:4222,nats://h2:4222"
    )
    assert redact_url("nats://t0ken@h:4222") == "nats://***@h:4222"
    assert redact_url("nats://h:4222") == "nats://h:4222"
    assert url_has_secret("nats://a:1,nats://u:p@b:2") and not url_has_secret("nats://a:1")


def test_no_secret_on_a_child_command_line():
    spec = ActorSpec("w", "m:C", "nats://h:4222", env=NatsCredentials("u", "pw").child_env())
    assert "pw" not in " ".join(spec.command())
    with pytest.raises(ValueError, match="password"):
        ActorSpec("w", "m:C", "nats://h:4222", bus_options={"password": "pw"}).command()
    with pytest.raises(ValueError, match="url"):
        ActorSpec("w", "m:C", "nats://u:pw@h:4222").command()


def test_nats_auth_writes_private_password_files_once(tmp_path: Path):
    folder = tmp_path / "creds"
    first = nats_auth_config("prod.shoal", folder, ["gateway", "worker"])
    assert nats_auth_config("prod.shoal", folder, ["gateway", "worker"]) == first
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for role in ("gateway", "worker"):
        path = folder / f"{role}.password"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert path.read_text().strip() in first
    assert '"prod-shoal-gateway"' in first and "prod.shoal.v1.engine.*.in" in first
    # an operator's own password file: the server gets exactly what the actor will send
    (folder / "tier.password").write_text("  spaced pw \n")
    config = nats_auth_config("prod.shoal", folder, ["tier"])
    sent = resolve_credentials("prod-shoal-tier", folder / "tier.password", environ={})
    assert sent is not None and f'password: "{sent.password}"' in config
