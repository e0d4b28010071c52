"""Least privilege on the bus: each actor role's NATS publish/subscribe permissions, built from
``bus.subjects`` (the one source of truth: a grant names a ``Subjects`` method and its
arguments, ``ANY`` where an id varies), and the nats-server ``authorization`` block giving one
user per role. Pure: no I/O.

Every actor role may publish its own kind's heartbeat and status and chunked-transfer pulls
(``Subjects.transfers``), and subscribe to its own kind's restart commands, every heartbeat and
status, its own reply inboxes only
(``Subjects.inbox_prefix(user)``) and its own transfers only (``Subjects.transfer_prefix(user)``:
``NatsBus`` takes both prefixes when it connects as a user). It answers requests through
nats-server's ``allow_responses`` (``Responses``: one message to the reply subject of each
message it received, within ``RESPONSE_EXPIRES_S``), not a grant on every inbox, so it cannot
forge a reply into another's request in flight; the gateway's streamed NATS API answers (any
number of messages) go to the ``client`` role's inboxes, granted by name.

JetStream buckets a role uses are granted by name (``BUCKETS``): the JetStream API of their
stream (read, and purge where the role deletes from it) and their data subjects. No actor role
may create a bucket or stream (whoever may create one names its subjects, so could read any
traffic): the ``provisioner`` role does, once, through ``shoal nats-init``. See
``docs/security.md``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from shoal.bus.subjects import API_CANCEL, API_OPERATIONS, Subjects, subject_matches

ANY = "*"  # a grant argument standing for every id (a "*" token)
USER = "<user>"  # a grant argument standing for the role's own NATS user name
_OF_ROLE = "<user-of>"  # user_of(role): a grant argument standing for another role's user
# How long after receiving a request an actor may answer it: above the longest any shoal request
# waits (a step: step_timeout_s, 120 s, after the one queued before it; a group join; a recovery
# command, 60 s). nats-server forgets a request never answered after it (max 1: an answered one
# at once); with no expiry it would keep each unanswered one for the connection's life.
RESPONSE_EXPIRES_S = 600
_ANY_TOKEN = "zzANYzz"  # what ANY is passed as to a Subjects method, then made "*"


@dataclass(frozen=True)
class Grant:
    """The subject ``Subjects.<method>(*args)`` (``ANY`` ids become ``*``), plus ``tail``
    tokens (``">"``: everything below it)."""

    method: str
    args: tuple[str, ...] = ()
    tail: str = ""

    def pattern(self, subjects: Subjects, user: str) -> str:
        args = [_ANY_TOKEN if a == ANY else user if a == USER else a for a in self.args]
        args = [_role_user(subjects, a) if a.startswith(_OF_ROLE) else a for a in args]
        subject: str = getattr(subjects, self.method)(*args)
        tokens = ["*" if t == _ANY_TOKEN else t for t in subject.split(".")]
        return ".".join(tokens + ([self.tail] if self.tail else []))


def _g(method: str, *args: str, tail: str = "") -> Grant:
    return Grant(method, args, tail)


API_GRANTS = tuple(_g("api", op) for op in (*API_OPERATIONS, API_CANCEL))


def user_of(role: str) -> str:
    """A grant argument standing for ``role``'s NATS user (``user_name``) in the namespace."""
    return f"{_OF_ROLE}{role}"


def _role_user(subjects: Subjects, arg: str) -> str:
    return user_name(subjects.namespace, arg.removeprefix(_OF_ROLE))


@dataclass(frozen=True)
class Responses:
    """nats-server's ``allow_responses``: the user may publish ``max_msgs`` messages to the
    reply subject of each message delivered to it, within ``expires_s`` of the delivery, even
    where no grant allows that subject (a deny neither: the requester picks the subject)."""

    max_msgs: int = 1
    expires_s: int = RESPONSE_EXPIRES_S

    def config(self) -> str:
        return f'{{ max: {self.max_msgs}, expires: "{self.expires_s}s" }}'


ONE_REPLY = Responses()  # every actor's and the client's: each request answered once


@dataclass(frozen=True)
class BucketGrant:
    """A JetStream bucket or stream (``BUCKETS`` kind, the ``Subjects`` method naming it) and
    what the role does to it beyond reading: purging subjects from it, creating it."""

    kind: str
    method: str
    purge: bool = False
    create: bool = False


@dataclass(frozen=True)
class Role:
    """What one role may publish and subscribe to; ``deny_*`` are refused even if a later
    allow would match (the issue's required denials, kept explicit)."""

    kind: str  # the actor kind of its heartbeat and status
    publish: tuple[Grant, ...]
    subscribe: tuple[Grant, ...]
    deny_publish: tuple[Grant, ...] = ()
    deny_subscribe: tuple[Grant, ...] = ()
    buckets: tuple[BucketGrant, ...] = ()
    actor: bool = True  # an actor: heartbeat, status, the common grants and ONE_REPLY
    responses: Responses | None = None  # answering requests (actors: ONE_REPLY)


# Every actor: chunk pulls (from any sender: a manifest names the subject), its own replies and
# transfers, and everyone's heartbeats and status. Replies go out by ``Role.responses``.
COMMON_PUBLISH = (_g("transfers"),)
COMMON_SUBSCRIBE = (
    _g("inbox_prefix", USER, tail=">"),
    _g("transfer_prefix", USER, tail=">"),
    _g("heartbeat", ANY),
    _g("status", ANY),
)
NEVER_FROM_OUTSIDE_THE_ENGINE = (  # only engine cores send steps and client outputs
    _g("worker_in", ANY),
    _g("worker_grammar", ANY),
    _g("engine_out", ANY),
)
CONTROL = _g("control", ANY, ANY)

ROLES: dict[str, Role] = {
    # The gateway process: HTTP + NATS API + the engine client (tokenize, route, stream).
    # Its NATS API answers a request with any number of messages (a stream of chunks): no
    # bounded allow_responses covers that, so the client role's inboxes are granted by name.
    "gateway": Role(
        kind="gateway",
        publish=(_g("engine_in", ANY), _g("inbox_prefix", user_of("client"), tail=">")),
        subscribe=(
            _g("engine_out", ANY),
            _g("engine_stats", ANY),
            _g("kv_events", ANY),
            _g("tier_kv_events", ANY),
            *API_GRANTS,
        ),
        deny_publish=(CONTROL, *NEVER_FROM_OUTSIDE_THE_ENGINE, _g("engine_results", ANY)),
        buckets=(
            BucketGrant("stream", "kv_events_stream"),  # replayed into the routing index
            BucketGrant("obj", "lora_bucket"),  # fetches an adapter to check it
            BucketGrant("kv", "responses_bucket"),  # stores and reads stored responses
        ),
    ),
    "engine": Role(
        kind="engine",
        publish=(
            _g("engine_out", ANY),
            _g("engine_stats", ANY),
            _g("worker_in", ANY),
            _g("worker_grammar", ANY),
            _g("tier_in", ANY),
            _g("lockstep"),
            _g("kv_events", ANY),
        ),
        subscribe=(
            _g("engine_in", ANY),
            _g("engine_results", ANY),
            _g("control", "engine", ANY),
            _g("lockstep"),
        ),
        deny_publish=(CONTROL,),
        buckets=(BucketGrant("stream", "kv_events_stream"),),  # published to as subjects
    ),
    "worker": Role(
        kind="worker",
        publish=(_g("engine_results", ANY),),
        subscribe=(_g("worker_in", ANY), _g("worker_grammar", ANY)),
        deny_publish=(CONTROL, *NEVER_FROM_OUTSIDE_THE_ENGINE, _g("engine_in", ANY)),
        buckets=(
            BucketGrant("kv", "group_ports_bucket"),
            BucketGrant("obj", "lora_bucket"),  # fetches the adapters it is asked for
        ),
    ),
    # Every KV tier (cpu, fs, obj, p2p): one role, the tiers ask each other.
    "tier": Role(
        kind="tier",
        publish=(
            _g("tier_in", ANY),
            _g("tier_peers"),
            _g("tier_peer_reads", ANY),
            _g("tier_peer_answers", ANY),
            _g("tier_kv_events", ANY),
        ),
        subscribe=(
            _g("tier_in", ANY),
            _g("tier_peers"),
            _g("tier_peer_reads", ANY),
            _g("tier_peer_answers", ANY),
        ),
        deny_publish=(
            CONTROL,
            *NEVER_FROM_OUTSIDE_THE_ENGINE,
            _g("engine_in", ANY),
            _g("engine_results", ANY),
        ),
        deny_subscribe=(_g("engine_in", ANY), _g("engine_results", ANY), CONTROL),
        buckets=(
            BucketGrant("obj", "object_bucket", purge=True),  # evictions purge chunks
            BucketGrant("stream", "kv_events_stream"),  # published to as subjects
        ),
    ),
    "recovery": Role(
        kind="recovery",
        publish=(_g("control", "engine", ANY),),
        subscribe=(),
        deny_publish=(*NEVER_FROM_OUTSIDE_THE_ENGINE, _g("engine_in", ANY)),
    ),
    # A process launcher (bus.runtime.supervisor): reports a dead child's DEAD status for it.
    "supervisor": Role(
        kind="supervisor",
        publish=(_g("status", ANY),),
        subscribe=(_g("inbox_prefix", USER, tail=">"), _g("heartbeat", ANY), _g("status", ANY)),
        deny_publish=(CONTROL, *NEVER_FROM_OUTSIDE_THE_ENGINE, _g("engine_in", ANY)),
        actor=False,
    ),
    # Another system calling the gateway's NATS API (with inbox prefix ``_INBOX.<user>`` and, for
    # requests above max_payload, transfers under ``_SHOAL_XFER.<user>``, which the gateway
    # pulls: answered by ONE_REPLY); it pulls the gateway's chunked answers.
    "client": Role(
        kind="client",
        publish=(
            *API_GRANTS,
            _g("transfer_prefix", user_of("gateway"), tail=">"),
        ),
        subscribe=(_g("inbox_prefix", USER, tail=">"), _g("transfer_prefix", USER, tail=">")),
        deny_publish=(CONTROL, *NEVER_FROM_OUTSIDE_THE_ENGINE, _g("engine_in", ANY)),
        actor=False,
        responses=ONE_REPLY,
    ),
    # ``shoal status``/``top``/``restart``: watches every actor and restarts them one at a time.
    "operator": Role(
        kind="operator",
        publish=(_g("restart", ANY, ANY),),
        subscribe=(_g("inbox_prefix", USER, tail=">"), _g("heartbeat", ANY), _g("status", ANY)),
        deny_publish=(CONTROL, *NEVER_FROM_OUTSIDE_THE_ENGINE, _g("engine_in", ANY)),
        actor=False,
    ),
    # ``shoal nats-init``: creates the namespace's buckets and stream, once, before the actors.
    "provisioner": Role(
        kind="provisioner",
        publish=(),
        subscribe=(_g("inbox_prefix", USER, tail=">"),),
        deny_publish=(CONTROL, *NEVER_FROM_OUTSIDE_THE_ENGINE, _g("engine_in", ANY)),
        buckets=(
            BucketGrant("kv", "group_ports_bucket", create=True),
            BucketGrant("obj", "object_bucket", create=True),
            BucketGrant("obj", "lora_bucket", create=True),  # and pushes adapters to it
            BucketGrant("kv", "responses_bucket", create=True),
            BucketGrant("stream", "kv_events_stream", create=True),
        ),
        actor=False,
    ),
}

# Subjects methods that name no subject anyone is granted (the coverage test reads this).
NOT_GRANTED = {
    "all": "a debugging tap of every subject: for an operator's own unrestricted user",
    "inboxes": "every reply inbox: replies go out by allow_responses (Role.responses)",
    "api_queue": "a queue group name, not a subject",
    "api_generate": "the subject api('generate'), granted with the other API_OPERATIONS",
}


def _stream_api(stream: str, *, purge: bool = False, create: bool = False) -> list[str]:
    """The JetStream API subjects nats-py uses on one stream: info, reads, consumers, acks and
    flow control; ``purge``: filtered purges too; ``create``: creating and updating it. NATS
    names them."""
    api = "$JS.API"
    subjects = [
        f"{api}.STREAM.INFO.{stream}",
        f"{api}.STREAM.MSG.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}.>",
        f"{api}.CONSUMER.CREATE.{stream}",
        f"{api}.CONSUMER.CREATE.{stream}.>",
        f"{api}.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"{api}.CONSUMER.DELETE.{stream}.>",
        f"{api}.CONSUMER.INFO.{stream}.>",
        f"{api}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]
    if purge:
        subjects.append(f"{api}.STREAM.PURGE.{stream}")
    if create:  # and bring its replicas to the deployment's (``bus.jetstream.replicas``)
        subjects += [f"{api}.STREAM.CREATE.{stream}", f"{api}.STREAM.UPDATE.{stream}"]
    return subjects


# JetStream kinds: bucket name → (stream name, data subjects).
BUCKETS = {
    "kv": lambda name: (f"KV_{name}", [f"$KV.{name}.>"]),
    "obj": lambda name: (f"OBJ_{name}", [f"$O.{name}.>"]),
    "stream": lambda name: (name, []),  # a plain stream: its subjects are granted as subjects
}


def user_name(namespace: str, role: str) -> str:
    """The NATS user of ``role`` in ``namespace`` (``shoal-gateway``; dots become dashes)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose from {', '.join(ROLES)}")
    return f"{namespace.replace('.', '-')}-{role}"


@dataclass(frozen=True)
class Permissions:
    """One user's allow/deny subject patterns."""

    user: str
    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)
    deny_publish: list[str] = field(default_factory=list)
    deny_subscribe: list[str] = field(default_factory=list)
    responses: Responses | None = None  # allow_responses

    def may_publish(self, subject: str) -> bool:
        return _allowed(subject, self.publish, self.deny_publish)

    def may_subscribe(self, subject: str) -> bool:
        return _allowed(subject, self.subscribe, self.deny_subscribe)


def permissions(namespace: str, role: str, *, gateway_may_command: bool = False) -> Permissions:
    """``role``'s permissions in ``namespace``. ``gateway_may_command`` lets the gateway send
    recovery commands (vLLM's ``POST /fault_tolerance/apply``), refused by default."""
    subjects, user, spec = Subjects(namespace), user_name(namespace, role), ROLES[role]
    pub, sub = list(spec.publish), list(spec.subscribe)
    deny_pub = list(spec.deny_publish)
    if spec.actor:
        pub += [*COMMON_PUBLISH, _g("heartbeat", spec.kind), _g("status", spec.kind)]
        sub += [*COMMON_SUBSCRIBE, _g("restart", spec.kind, ANY)]
    if role == "gateway" and gateway_may_command:
        pub.append(_g("control", "engine", ANY))
        deny_pub.remove(CONTROL)
    perms = Permissions(
        user,
        _unique(g.pattern(subjects, user) for g in pub),
        _unique(g.pattern(subjects, user) for g in sub),
        _unique(g.pattern(subjects, user) for g in deny_pub),
        _unique(g.pattern(subjects, user) for g in spec.deny_subscribe),
        ONE_REPLY if spec.actor else spec.responses,
    )
    for bucket in spec.buckets:
        stream, data = BUCKETS[bucket.kind](getattr(subjects, bucket.method)())
        perms.publish.extend(_stream_api(stream, purge=bucket.purge, create=bucket.create) + data)
    if spec.buckets:  # nats-py finds a stream by its subject (names only, no contents)
        perms.publish.append("$JS.API.STREAM.NAMES")
    return perms


def _unique(patterns: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(patterns))


def _allowed(subject: str, allow: list[str], deny: list[str]) -> bool:
    if any(subject_matches(d, subject) for d in deny):
        return False
    return any(subject_matches(a, subject) for a in allow)


def authorization_config(
    namespace: str, passwords: Mapping[str, str], *, gateway_may_command: bool = False
) -> str:
    """The nats-server ``authorization { users = [...] }`` block: one user per role in
    ``passwords`` (role → its password; plain text, so keep the file 0600)."""
    users = []
    for role, password in passwords.items():
        perms = permissions(namespace, role, gateway_may_command=gateway_may_command)
        users.append(_user_block(perms, password))
    return "authorization {\n  users = [\n" + "\n".join(users) + "\n  ]\n}\n"


def _user_block(perms: Permissions, password: str) -> str:
    def rule(allow: list[str], deny: list[str]) -> str:
        parts = [f"allow: {json.dumps(allow)}"] + ([f"deny: {json.dumps(deny)}"] if deny else [])
        return "{ " + ", ".join(parts) + " }"

    responses = perms.responses
    return (
        f"    {{ user: {json.dumps(perms.user)}, password: {json.dumps(password)},\n"
        f"      permissions: {{\n"
        f"        publish: {rule(perms.publish, perms.deny_publish)}\n"
        f"        subscribe: {rule(perms.subscribe, perms.deny_subscribe)}\n"
        + (f"        allow_responses: {responses.config()}\n" if responses else "")
        + "      } }"
    )
