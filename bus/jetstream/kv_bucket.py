"""The key-value bucket on NATS: ``NatsKvBucket``, a JetStream KV bucket (``NatsBus.open_kv``;
put/get/delete/history/watch, per-key TTL). The Object Store is ``bus.jetstream.object_store``; the
interface both buses share is ``bus.buckets``."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from shoal.bus.buckets import KvBucket, KvEntry, ValueTooLargeError, check_key
from shoal.bus.errors import BusTimeoutError
from shoal.bus.jetstream.create import open_guarded
from shoal.bus.transport.nats_connected import NatsConnectedBus

__all__ = ["KvEntry", "NatsKvBucket"]


class NatsKvBucket(KvBucket):
    """A JetStream key-value bucket. ``open`` creates it when missing (where the user may:
    ``bus.jetstream.create``)."""

    def __init__(self, kv: KeyValue, js: JetStreamContext, name: str) -> None:
        self._kv = kv
        self._js = js
        self.name = name

    @classmethod
    async def open(
        cls,
        bus: NatsConnectedBus,
        name: str,
        *,
        history: int = 1,
        ttl_s: float | None = None,
        replicas: int = 1,
    ) -> NatsKvBucket:
        """Open (or create) bucket ``name``; ``ttl_s`` is the bucket-wide max age, ``replicas``
        the copies a cluster keeps."""
        js = bus.client.jetstream(timeout=5.0)
        config = api.KeyValueConfig(bucket=name, history=history, ttl=ttl_s, replicas=replicas)
        kv = await open_guarded(bus, f"KV_{name}", f"key-value bucket {name!r}", _open(js, config))
        return cls(kv, js, name)

    async def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        check_key(key)
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"per-key ttl must be at least 1 s, got {ttl_s}")
        try:
            if ttl_s is None:
                return await self._kv.put(key, value)
            ack = await self._js.publish(f"$KV.{self.name}.{key}", value, msg_ttl=ttl_s)
        except nats.errors.MaxPayloadError:
            raise ValueTooLargeError(f"{len(value)} bytes for key {key!r}") from None
        return ack.seq

    async def get(self, key: str) -> bytes | None:
        try:
            entry = await self._kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value

    async def delete(self, key: str) -> None:
        check_key(key)
        await self._kv.delete(key)

    async def history(self, key: str) -> list[KvEntry]:
        try:
            entries = await self._kv.history(key)
        except nats.js.errors.NoKeysError:
            return []
        return [_entry(entry) for entry in entries]

    async def watch(
        self, keys: str = ">", *, timeout: float = 5.0
    ) -> AsyncGenerator[KvEntry, None]:
        watcher = await self._kv.watch(keys)
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=timeout)
                except nats.errors.TimeoutError:
                    raise BusTimeoutError(f"no update of {keys!r} within {timeout}s") from None
                if entry is None:  # the marker "caught up with existing keys"
                    continue
                yield _entry(entry)
        finally:
            await watcher.stop()


async def _open(js: JetStreamContext, config: api.KeyValueConfig) -> KeyValue:
    assert config.bucket is not None
    try:
        return await js.key_value(config.bucket)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_key_value(config)


def _entry(entry: KeyValue.Entry) -> KvEntry:
    value = None if entry.operation in ("DEL", "PURGE") else entry.value
    return KvEntry(entry.key, value, entry.revision or 0)
