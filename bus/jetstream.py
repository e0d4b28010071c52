"""JetStream helpers on a ``NatsBus``: a key-value bucket (put/get/delete/watch, per-key TTL)
and an Object Store whose ``get`` pulls chunks with a pull consumer into one buffer (nats-py's
own ``get`` concatenates bytes chunk by chunk, which is slow for multi-MiB objects)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore as NatsObjectStore

from shoal.bus.base import BusTimeoutError, PayloadIntegrityError
from shoal.bus.nats_bus import NatsBus

FETCH_BATCH = 64


@dataclass(frozen=True)
class KvEntry:
    key: str
    value: bytes | None  # None: deleted, purged or expired
    revision: int


def _jetstream(bus: NatsBus, timeout: float) -> JetStreamContext:
    return bus.client.jetstream(timeout=timeout)


class KvBucket:
    """A JetStream key-value bucket. ``open`` creates it when missing."""

    def __init__(self, kv: KeyValue, js: JetStreamContext, name: str) -> None:
        self._kv = kv
        self._js = js
        self.name = name

    @classmethod
    async def open(
        cls, bus: NatsBus, name: str, *, history: int = 1, ttl_s: float | None = None
    ) -> KvBucket:
        """Open (or create) bucket ``name``; ``ttl_s`` is the bucket-wide max age."""
        js = _jetstream(bus, timeout=5.0)
        try:
            kv = await js.key_value(name)
        except nats.js.errors.BucketNotFoundError:
            kv = await js.create_key_value(bucket=name, history=history, ttl=ttl_s)
        return cls(kv, js, name)

    async def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        """Store ``value``; with ``ttl_s`` (whole seconds, at least 1) the key expires on its
        own. Returns the revision."""
        if ttl_s is None:
            return await self._kv.put(key, value)
        if ttl_s < 1:
            raise ValueError(f"per-key ttl must be at least 1 s, got {ttl_s}")
        ack = await self._js.publish(f"$KV.{self.name}.{key}", value, msg_ttl=ttl_s)
        return ack.seq

    async def get(self, key: str) -> bytes | None:
        try:
            entry = await self._kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value

    async def delete(self, key: str) -> None:
        await self._kv.delete(key)

    async def watch(
        self, keys: str = ">", *, timeout: float = 5.0
    ) -> AsyncGenerator[KvEntry, None]:
        """Yield the current value of each matching key, then every change, as ``KvEntry``
        (value None for a delete). Stop by breaking out of the loop. ``timeout`` bounds the
        wait for each next entry (``BusTimeoutError``)."""
        watcher = await self._kv.watch(keys)
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=timeout)
                except nats.errors.TimeoutError:
                    raise BusTimeoutError(f"no update of {keys!r} within {timeout}s") from None
                if entry is None:  # the marker "caught up with existing keys"
                    continue
                value = None if entry.operation in ("DEL", "PURGE") else entry.value
                yield KvEntry(entry.key, value, entry.revision)
        finally:
            await watcher.stop()


@dataclass(frozen=True)
class ObjectEntry:
    name: str
    size: int
    mtime: str  # when it was put (ISO 8601, UTC)


class ObjectStore:
    """A JetStream Object Store bucket for multi-MiB objects. ``open`` creates it when missing."""

    def __init__(self, store: NatsObjectStore, js: JetStreamContext, name: str) -> None:
        self._store = store
        self._js = js
        self.name = name

    @classmethod
    async def open(cls, bus: NatsBus, name: str, *, timeout: float = 10.0) -> ObjectStore:
        js = _jetstream(bus, timeout=timeout)
        try:
            store = await js.object_store(name)
        except nats.js.errors.BucketNotFoundError:
            store = await js.create_object_store(name)
        return cls(store, js, name)

    async def put(self, name: str, data: bytes) -> None:
        await self._store.put(name, data)

    async def delete(self, name: str) -> bool:
        """Remove an object; whether it was there. The delete marker nats-py leaves in the
        bucket's metadata is purged too, so deleted names do not pile up in every ``list``."""
        try:
            await self._store.delete(name)
        except nats.js.errors.ObjectNotFoundError:
            return False
        encoded = base64.urlsafe_b64encode(name.encode()).decode()
        await self._js.purge_stream(f"OBJ_{self.name}", subject=f"$O.{self.name}.M.{encoded}")
        return True

    async def list(self) -> list[ObjectEntry]:
        """The objects held (deleted ones left out), oldest put first."""
        try:
            infos = await self._store.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []
        entries = [ObjectEntry(i.name, i.size or 0, i.mtime or "") for i in infos if i.name]
        return sorted(entries, key=lambda e: e.mtime)  # ISO-8601 UTC stamps sort as text

    async def get(self, name: str, *, timeout: float = 10.0) -> bytes | bytearray | None:
        """The object's bytes (None if missing), read with a pull consumer and checked
        against its SHA-256 digest (in a thread: the loop is never held by a large object);
        ``PayloadIntegrityError`` if they do not match."""
        try:
            info = await self._store.get_info(name)
        except nats.js.errors.ObjectNotFoundError:
            return None
        size, num_chunks = info.size or 0, info.chunks or 0
        if size == 0:
            return b""
        subject = f"$O.{self.name}.C.{info.nuid}"
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL
        )
        sub = await self._js.pull_subscribe(subject, stream=f"OBJ_{self.name}", config=config)
        buffer = bytearray()
        try:
            async with asyncio.timeout(timeout):
                while len(buffer) < size:
                    wanted = min(FETCH_BATCH, num_chunks)
                    for msg in await sub.fetch(batch=wanted, timeout=timeout):
                        buffer += msg.data
        except TimeoutError:
            raise BusTimeoutError(f"object {name!r}: {len(buffer)}/{size} bytes") from None
        finally:
            await sub.unsubscribe()
        await asyncio.to_thread(_check_digest, name, buffer, info.digest or "")
        return buffer


def _check_digest(name: str, data: bytearray, digest: str) -> None:
    expected = digest.split("=", 1)[-1]
    actual = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
    if expected.rstrip("=") != actual.rstrip("="):
        raise PayloadIntegrityError(f"object {name!r}: digest mismatch")
