"""What every bus offers beside messages: a key-value bucket (``Bus.open_kv``) and an object
store (``Bus.open_object_store``). On NATS they are JetStream's (``bus.jetstream.kv_bucket``,
``bus.jetstream.object_store``); on the in-memory bus they live in the process, shared by every bus
of
one broker (``bus.transport.memory_jetstream``). Both behave alike
(``tests/actors/test_bucket_contract.py``):

- A bucket is opened, or created when missing; a bucket that exists keeps its own settings.
- KV: a put returns the revision (rising across the whole bucket); a key put with ``ttl_s``
  (whole seconds, at least 1) or in a bucket with a ``ttl_s`` is gone once that has passed
  (no watch entry says so); a delete is a revision of its own (value None); ``history`` keeps
  that many revisions per key; ``watch`` yields each matching key's latest revision, then every
  change. A value above the bus's ``max_payload`` is refused (``ValueTooLargeError``).
- Objects: any size (stored in chunks on NATS); a put records its writer and the object's
  SHA-256, checked on every read (``PayloadIntegrityError``); of overlapping puts of one name
  the first to finish wins (the others return False and leave nothing behind); a read that finds
  its object replaced or deleted meanwhile is a miss (None); ``list`` gives the live objects,
  oldest put first.
"""

from __future__ import annotations

import abc
import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from shoal.bus.errors import BusError

_BUCKET_NAME = re.compile(r"[A-Za-z0-9_-]+")
_KEY = re.compile(r"[-/_=.A-Za-z0-9]+")


class ValueTooLargeError(BusError):
    """A key-value put larger than the bus's ``max_payload``."""


def check_bucket_name(name: str) -> None:
    """A bucket is named with letters, digits, ``_`` and ``-`` (``ValueError`` otherwise)."""
    if not _BUCKET_NAME.fullmatch(name):
        raise ValueError(f"a bucket name is letters, digits, '_' or '-', got {name!r}")


def check_key(key: str) -> None:
    """A key is dot-separated tokens of ``[-/_=a-zA-Z0-9]`` (``ValueError`` otherwise)."""
    if not _KEY.fullmatch(key) or key.startswith(".") or key.endswith(".") or ".." in key:
        raise ValueError(f"invalid key {key!r}")


@dataclass(frozen=True)
class KvEntry:
    key: str
    value: bytes | None  # None: deleted or purged
    revision: int


@dataclass(frozen=True)
class ObjectEntry:
    name: str
    size: int
    mtime: str  # when it was put (ISO 8601, UTC)
    writer: str = ""  # who put it (``put(writer=...)``; "" when unknown)


class KvBucket(abc.ABC):
    """A key-value bucket (``Bus.open_kv``)."""

    name: str

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        """Store ``value``; with ``ttl_s`` (whole seconds, at least 1; ``ValueError`` below)
        the key expires on its own. Returns the revision."""

    @abc.abstractmethod
    async def get(self, key: str) -> bytes | None:
        """The key's value (None if missing, deleted or expired)."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    async def history(self, key: str) -> list[KvEntry]:
        """The key's revisions kept (at most the bucket's ``history``), oldest first."""

    @abc.abstractmethod
    def watch(self, keys: str = ">", *, timeout: float = 5.0) -> AsyncGenerator[KvEntry, None]:
        """Yield the latest revision of each key matching ``keys`` (``*`` and ``>`` as in
        subjects), then every change, as ``KvEntry`` (value None for a delete). Stop by
        breaking out of the loop. ``timeout`` bounds the wait for each next entry
        (``BusTimeoutError``)."""


class ObjectStore(abc.ABC):
    """An object store bucket for multi-MiB objects (``Bus.open_object_store``)."""

    name: str

    @property
    def num_orphans(self) -> int:
        """Pieces of cut-short puts not cleaned up yet (the server could not be reached)."""
        return 0

    async def close(self, timeout: float = 1.0) -> None:  # noqa: B027 (nothing by default)
        """Wait at most ``timeout`` for clean-ups still running in the background."""

    @abc.abstractmethod
    async def put(self, name: str, data: bytes, *, writer: str = "") -> bool:
        """Store ``data`` as ``name`` (replacing an object of that name), recording ``writer``;
        False if an overlapping put of the name finished first (its object stays). Cut short,
        it leaves nothing of it behind."""

    @abc.abstractmethod
    async def get(self, name: str, *, timeout: float = 10.0) -> bytes | bytearray | None:
        """The object's bytes (None if missing, or deleted or replaced while it was read),
        within ``timeout`` (``BusTimeoutError``); ``PayloadIntegrityError`` if they do not
        match its digest."""

    @abc.abstractmethod
    async def info(self, name: str) -> ObjectEntry | None:
        """The object's entry (None if missing)."""

    @abc.abstractmethod
    async def list(self) -> list[ObjectEntry]:
        """The objects held, oldest put first."""

    @abc.abstractmethod
    async def delete(self, name: str) -> bool:
        """Remove an object; whether it was there."""
