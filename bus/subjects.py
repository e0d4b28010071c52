"""Every subject name shoal uses, built in one place under a namespace prefix
(``<namespace>.v1.<role>.<id>.<verb>``) so two deployments can share one NATS cluster.

Ids and kinds are single tokens of ``[A-Za-z0-9_-]``; ``"*"`` may stand for an id where a method
says so, to subscribe to all of them (e.g. every engine's stats).
"""

from __future__ import annotations

import functools
import re

VERSION = "v1"
# Chunked transfers (``bus.transport.chunking``) are pulled on
# ``<TRANSFER_PREFIX>[.<user>].<sender>.<transfer>`` (``Subjects.transfer_prefix``); reply
# inboxes live under ``<INBOX_ROOT>.<user>`` (``Subjects.inbox_prefix``).
TRANSFER_PREFIX = "_SHOAL_XFER"
INBOX_ROOT = "_INBOX"
_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
_SUBJECT_TOKEN = re.compile(r"[^\s.*>]+")


class SubjectError(ValueError):
    """A subject, id or namespace that is not a valid name."""


def validate_token(value: str, what: str, *, wildcard: bool = False) -> str:
    if wildcard and value == "*":
        return value
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise SubjectError(f"{what} must be a non-empty token of [A-Za-z0-9_-], got {value!r}")
    return value


def validate_subject(subject: str, *, wildcards: bool = False) -> str:
    """A NATS subject: non-empty dot-separated tokens without spaces; ``*``/``>`` (``>`` last
    only) when ``wildcards``. Raises ``SubjectError``."""
    if not isinstance(subject, str) or not subject:
        raise SubjectError(f"subject must be a non-empty string, got {subject!r}")
    return _check_subject(subject, wildcards)


@functools.lru_cache(maxsize=8192)
def _check_subject(subject: str, wildcards: bool) -> str:
    tokens = subject.split(".")
    for i, token in enumerate(tokens):
        if wildcards and (token == "*" or (token == ">" and i == len(tokens) - 1)):
            continue
        if not _SUBJECT_TOKEN.fullmatch(token):
            raise SubjectError(f"invalid subject {subject!r} (token {i}: {token!r})")
    return subject


def tokens_match(pattern: tuple[str, ...], subject: tuple[str, ...]) -> bool:
    """NATS matching of split subjects: ``*`` is one token, a trailing ``>`` one or more."""
    for i, token in enumerate(pattern):
        if token == ">":
            return len(subject) > i
        if i >= len(subject) or (token != "*" and token != subject[i]):
            return False
    return len(pattern) == len(subject)


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` matches the NATS ``pattern`` (``tokens_match`` of the dotted forms)."""
    return tokens_match(tuple(pattern.split(".")), tuple(subject.split(".")))


# The gateway's public NATS API: its request/reply operations (``Subjects.api(op)``, served in
# the queue group) and ``cancel`` (every gateway hears it).
API_OPERATIONS = ("generate", "embeddings", "responses", "responses_get", "messages")
API_CANCEL = "cancel"


class Subjects:
    """Builds the subjects of one deployment. ``namespace`` may be dotted (``"prod.shoal"``)."""

    def __init__(self, namespace: str = "shoal") -> None:
        for part in namespace.split("."):
            validate_token(part, "namespace token")
        self.namespace = namespace
        self._root = f"{namespace}.{VERSION}"

    def __repr__(self) -> str:
        return f"Subjects({self.namespace!r})"

    def _build(self, role: str, actor_id: str, verb: str, *, wildcard: bool = False) -> str:
        validate_token(actor_id, f"{role} id", wildcard=wildcard)
        return f"{self._root}.{role}.{actor_id}.{verb}"

    # engine client ↔ engine core
    def engine_in(self, engine_id: str) -> str:
        """An engine core's inbox: ``EngineInbound`` (AddRequest, AbortRequest)."""
        return self._build("engine", engine_id, "in")

    def engine_out(self, client_id: str) -> str:
        """One engine client's outputs: ``EngineOutbound`` from every engine core."""
        return self._build("client", client_id, "out")

    def engine_stats(self, engine_id: str = "*") -> str:
        """``EngineStats`` of one engine core (``"*"``: all of them)."""
        return self._build("engine", engine_id, "stats", wildcard=True)

    def kv_events(self, engine_id: str = "*") -> str:
        """``KVEventBatch`` of one engine core's prefix cache (``"*"``: all of them)."""
        return self._build("engine", engine_id, "kv_events", wildcard=True)

    def engine_results(self, engine_id: str) -> str:
        """Where an engine core's workers send ``StepResult``."""
        return self._build("engine", engine_id, "results")

    def lockstep(self) -> str:
        """Rounds of the engine cores that run in lock-step (``LockstepMessage``)."""
        return f"{self._root}.engine.lockstep.rounds"

    # engine core ↔ worker
    def worker_in(self, worker_id: str) -> str:
        """A worker's inbox: ``WorkerInbound`` (ExecuteStep, ResetWorker)."""
        return self._build("worker", worker_id, "in")

    def worker_grammar(self, worker_id: str) -> str:
        """A step's grammar bitmask sent after the step (``StepGrammar``: async scheduling),
        apart from the inbox, which a running step holds."""
        return self._build("worker", worker_id, "grammar")

    # engine core ↔ KV offload tiers
    def tier_in(self, tier_id: str) -> str:
        """A KV tier's inbox: ``TierInbound`` requests (or ``SecondaryInbound``)."""
        return self._build("tier", tier_id, "in")

    def tier_peers(self) -> str:
        """Where the peer-to-peer tiers of every host ask each other (``PeerLookup``)."""
        return f"{self._root}.tier.peers.lookup"

    def tier_peer_reads(self, tier_id: str) -> str:
        """A peer-to-peer tier's chunk reads and session ends (``PeerRead``, ``PeerDone``)."""
        return self._build("tier", tier_id, "peer")

    def tier_peer_answers(self, tier_id: str) -> str:
        """Where a peer-to-peer tier's lookup rounds are answered (``PeerHeld``)."""
        return self._build("tier", tier_id, "answers")

    def tier_kv_events(self, tier_id: str = "*") -> str:
        """``KVEventBatch`` of one KV tier's chunks (``"*"``: every tier): prefix routing."""
        return self._build("tier", tier_id, "kv_events", wildcard=True)

    # any actor
    def control(self, kind: str, actor_id: str) -> str:
        """Commands to one actor (recovery, shutdown)."""
        validate_token(kind, "actor kind")
        return self._build(kind, actor_id, "control")

    def restart(self, kind: str, actor_id: str) -> str:
        """``RestartActor`` to one actor (every actor serves it; ``"*"``: every id)."""
        validate_token(kind, "actor kind", wildcard=True)
        return self._build(kind, actor_id, "restart", wildcard=True)

    def heartbeat(self, kind: str = "*") -> str:
        """``Heartbeat`` of every actor of a kind (``"*"``: every kind)."""
        return self._build("control", kind, "heartbeat", wildcard=True)

    def status(self, kind: str = "*") -> str:
        """``StatusEvent`` of every actor of a kind (``"*"``: every kind)."""
        return self._build("control", kind, "status", wildcard=True)

    # public NATS API of the gateway
    def api(self, verb: str) -> str:
        validate_token(verb, "api verb")
        return f"{self._root}.api.{verb}"

    def api_generate(self) -> str:
        """The gateway's public request/reply generate subject (streamed replies)."""
        return self.api("generate")

    def api_queue(self) -> str:
        """Queue group of the gateways serving the public API (one gateway per request)."""
        return f"{self.namespace.replace('.', '-')}-api"

    # JetStream buckets (names of [A-Za-z0-9_-])
    def group_ports_bucket(self) -> str:
        """KV bucket of the tensor-parallel groups' rendezvous addresses, keyed by epoch."""
        return f"{self.namespace.replace('.', '-')}-group-ports"

    def kv_events_stream(self) -> str:
        """JetStream stream capturing every engine core's ``kv_events`` and every tier's
        ``tier_kv_events`` (prefix routing)."""
        return f"{self.namespace.replace('.', '-')}-kv-events"

    def responses_bucket(self) -> str:
        """Key-value bucket of stored responses (the Responses API's ``store``), any gateway's."""
        return f"{self.namespace.replace('.', '-')}-responses"

    def lora_bucket(self) -> str:
        """Object Store bucket of the deployment's LoRA adapters (``shoal lora push``)."""
        return f"shoal_lora_{self.namespace.replace('.', '_')}"

    def object_bucket(self) -> str:
        """Object Store bucket of the deployment's object KV tier (``shoal_kv_<namespace>``)."""
        return f"shoal_kv_{self.namespace.replace('.', '_')}"

    # reply inboxes and chunked transfers (not namespaced: nats-py and bus.transport.chunking
    # name them)
    def inbox_prefix(self, user: str) -> str:
        """The reply inboxes of a bus connected as NATS user ``user`` (``_INBOX.<user>``): a
        user may subscribe to its own inboxes only, so no one reads another's replies."""
        return f"{INBOX_ROOT}.{validate_token(user, 'NATS user')}"

    def inboxes(self) -> str:
        """Every reply inbox (where replies are published)."""
        return f"{INBOX_ROOT}.>"

    def transfer_prefix(self, user: str) -> str:
        """The chunked transfers a bus connected as NATS user ``user`` offers
        (``_SHOAL_XFER.<user>``): a user may subscribe to its own only, so no one sees another's
        chunk pulls (and learns the transfer subjects to pull from)."""
        return f"{TRANSFER_PREFIX}.{validate_token(user, 'NATS user')}"

    def transfers(self) -> str:
        """Every chunked transfer's pull subject (``bus.transport.chunking``)."""
        return f"{TRANSFER_PREFIX}.>"

    def all(self) -> str:
        """Every subject of this deployment (for debugging taps)."""
        return f"{self._root}.>"
