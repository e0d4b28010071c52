"""JetStream helpers on a ``NatsBus``: a key-value bucket (put/get/delete/watch, per-key TTL).
The Object Store is ``bus.object_store``."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from shoal.bus.base import BusTimeoutError
from shoal.bus.nats_bus import NatsBus


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
        cls,
        bus: NatsBus,
        name: str,
        *,
        history: int = 1,
        ttl_s: float | None = None,
        replicas: int = 1,
    ) -> KvBucket:
        """Open (or create) bucket ``name``; ``ttl_s`` is the bucket-wide max age, ``replicas``
        how many nodes of a NATS cluster keep a copy (at most the cluster's size; 3 survives
        losing one node). An existing bucket is opened as it is."""
        js = _jetstream(bus, timeout=5.0)
        try:
            kv = await js.key_value(name)
        except nats.js.errors.BucketNotFoundError:
            kv = await js.create_key_value(
                bucket=name, history=history, ttl=ttl_s, replicas=replicas
            )
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
