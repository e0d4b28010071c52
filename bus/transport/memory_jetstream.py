"""The key-value buckets and object stores of the in-memory bus (``InMemoryBus.open_kv``,
``InMemoryBus.open_object_store``), with JetStream's semantics (``bus.buckets``).

A bucket's state belongs to the broker: every ``InMemoryBus`` of one broker (the actors of one
``memory://NAME``) opens the same bucket of a name, and it lives as long as the broker. Expiry
is checked when a key is read (nothing runs in the background). Objects are whole ``bytes``
with their SHA-256, checked (in a thread) on every read.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
import weakref
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from shoal.bus.base import Bus
from shoal.bus.buckets import (
    KvBucket,
    KvEntry,
    ObjectEntry,
    ObjectStore,
    ValueTooLargeError,
    check_key,
)
from shoal.bus.errors import BusClosedError, BusTimeoutError, PayloadIntegrityError
from shoal.bus.subjects import tokens_match


@dataclass
class _Revision:
    entry: KvEntry
    expires_at: float | None  # time.monotonic(); None: never


@dataclass
class _KvState:
    history: int
    ttl_s: float | None
    revisions: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    keys: dict[str, deque[_Revision]] = field(default_factory=dict)
    watchers: dict[asyncio.Queue[KvEntry], tuple[str, ...]] = field(default_factory=dict)

    def live(self, key: str) -> list[_Revision]:
        """The key's revisions not expired (the expired ones dropped)."""
        kept = self.keys.get(key)
        if kept is None:
            return []
        now = time.monotonic()
        while kept and kept[0].expires_at is not None and kept[0].expires_at <= now:
            kept.popleft()
        live = [r for r in kept if r.expires_at is None or r.expires_at > now]
        if not live:
            del self.keys[key]
        return live

    def add(self, key: str, value: bytes | None, ttl_s: float | None) -> int:
        ttl = ttl_s if ttl_s is not None else self.ttl_s
        entry = KvEntry(key, value, next(self.revisions))
        expires_at = time.monotonic() + ttl if ttl else None
        self.keys.setdefault(key, deque(maxlen=self.history)).append(_Revision(entry, expires_at))
        tokens = tuple(key.split("."))
        for queue, pattern in self.watchers.items():
            if tokens_match(pattern, tokens):
                queue.put_nowait(entry)
        return entry.revision

    def watcher(self, keys: str) -> asyncio.Queue[KvEntry]:
        """A queue holding the latest revision of each matching key, then fed every change."""
        pattern = tuple(keys.split("."))
        latest = []
        for key in list(self.keys):
            live = self.live(key)
            if live and tokens_match(pattern, tuple(key.split("."))):
                latest.append(live[-1].entry)
        queue: asyncio.Queue[KvEntry] = asyncio.Queue()
        for entry in sorted(latest, key=lambda e: e.revision):
            queue.put_nowait(entry)
        self.watchers[queue] = pattern
        return queue


@dataclass(frozen=True)
class _Object:
    entry: ObjectEntry
    data: bytes
    digest: bytes
    version: int


@dataclass
class _ObjectState:
    versions: itertools.count[int] = field(default_factory=itertools.count)
    objects: dict[str, _Object] = field(default_factory=dict)


@dataclass
class _Buckets:
    """The buckets of one broker."""

    kv: dict[str, _KvState] = field(default_factory=dict)
    objects: dict[str, _ObjectState] = field(default_factory=dict)


_BUCKETS: weakref.WeakKeyDictionary[object, _Buckets] = weakref.WeakKeyDictionary()


def buckets_of(broker: object) -> _Buckets:
    """The buckets shared by the buses of ``broker``."""
    return _BUCKETS.setdefault(broker, _Buckets())


class MemoryKvBucket(KvBucket):
    """A key-value bucket of an in-memory broker."""

    def __init__(self, bus: Bus, state: _KvState, name: str, max_value: int | None) -> None:
        self._bus = bus
        self._state = state
        self._max_value = max_value
        self.name = name

    @classmethod
    def open(
        cls, bus: Bus, broker: object, name: str, *, history: int, ttl_s: float | None
    ) -> MemoryKvBucket:
        if not 1 <= history <= 64:
            raise ValueError(f"a bucket keeps 1 to 64 revisions per key, not {history}")
        kv = buckets_of(broker).kv
        state = kv.setdefault(name, _KvState(history, ttl_s))
        return cls(bus, state, name, getattr(bus, "max_payload", None))

    def _check_open(self) -> None:
        if not self._bus.is_connected:
            raise BusClosedError(f"bucket {self.name!r}: the bus is closed")

    async def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        self._check_open()
        check_key(key)
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"per-key ttl must be at least 1 s, got {ttl_s}")
        if self._max_value is not None and len(value) > self._max_value:
            raise ValueTooLargeError(f"{len(value)} bytes for key {key!r}")
        return self._state.add(key, bytes(value), ttl_s)

    async def get(self, key: str) -> bytes | None:
        self._check_open()
        live = self._state.live(key)
        return live[-1].entry.value if live else None

    async def delete(self, key: str) -> None:
        self._check_open()
        check_key(key)
        self._state.add(key, None, None)

    async def history(self, key: str) -> list[KvEntry]:
        self._check_open()
        return [revision.entry for revision in self._state.live(key)]

    async def watch(
        self, keys: str = ">", *, timeout: float = 5.0
    ) -> AsyncGenerator[KvEntry, None]:
        self._check_open()
        queue = self._state.watcher(keys)
        try:
            while True:
                try:
                    entry = await asyncio.wait_for(queue.get(), timeout)
                except TimeoutError:
                    raise BusTimeoutError(f"no update of {keys!r} within {timeout}s") from None
                yield entry
        finally:
            self._state.watchers.pop(queue, None)


class MemoryObjectStore(ObjectStore):
    """An object store bucket of an in-memory broker."""

    def __init__(self, bus: Bus, state: _ObjectState, name: str) -> None:
        self._bus = bus
        self._state = state
        self.name = name

    @classmethod
    def open(cls, bus: Bus, broker: object, name: str) -> MemoryObjectStore:
        return cls(bus, buckets_of(broker).objects.setdefault(name, _ObjectState()), name)

    def _check_open(self) -> None:
        if not self._bus.is_connected:
            raise BusClosedError(f"object store {self.name!r}: the bus is closed")

    async def put(self, name: str, data: bytes, *, writer: str = "") -> bool:
        """Stored only if the name's object is still the one found before the digest (or
        gone since): of overlapping puts the first to finish wins, as on NATS."""
        self._check_open()
        objects = self._state.objects
        last = objects.get(name)
        data = bytes(data)
        digest = (await asyncio.to_thread(hashlib.sha256, data)).digest()
        self._check_open()
        now = objects.get(name)
        if now is not None and now is not last:
            return False
        mtime = datetime.now(UTC).isoformat()
        entry = ObjectEntry(name, len(data), mtime, writer)
        objects[name] = _Object(entry, data, digest, next(self._state.versions))
        return True

    async def get(self, name: str, *, timeout: float = 10.0) -> bytes | bytearray | None:
        self._check_open()
        found = self._state.objects.get(name)
        if found is None:
            return None
        try:
            async with asyncio.timeout(timeout):
                actual = (await asyncio.to_thread(hashlib.sha256, found.data)).digest()
        except TimeoutError:
            raise BusTimeoutError(f"object {name!r}: not read within {timeout}s") from None
        if actual != found.digest:
            raise PayloadIntegrityError(f"object {name!r}: digest mismatch")
        if self._state.objects.get(name) is not found:
            return None  # deleted or put again while it was read: a miss
        return found.data

    async def info(self, name: str) -> ObjectEntry | None:
        self._check_open()
        found = self._state.objects.get(name)
        return found.entry if found is not None else None

    async def list(self) -> list[ObjectEntry]:
        self._check_open()
        held = sorted(self._state.objects.values(), key=lambda o: (o.entry.mtime, o.version))
        return [o.entry for o in held]

    async def delete(self, name: str) -> bool:
        self._check_open()
        return self._state.objects.pop(name, None) is not None
