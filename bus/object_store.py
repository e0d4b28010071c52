"""The JetStream Object Store on a ``NatsBus``: an ``ObjectStore`` whose ``get`` pulls chunks
with a pull consumer into one buffer (nats-py's own ``get`` concatenates bytes chunk by chunk,
which is slow for multi-MiB objects).

The ``put`` is shoal's own, in nats-py's format (objects stay readable by any NATS client): it
records who wrote an object (the meta's ``description``), digests in a thread, and leaves no
chunk messages behind when it is cut short, also by a cancellation (nats-py purges them only on
an ``Exception``): they are purged then, or by a later ``put`` if the server could not be
reached."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.object_store import ObjectStore as NatsObjectStore

from shoal.bus.base import BusTimeoutError, PayloadIntegrityError
from shoal.bus.nats_bus import NatsBus

FETCH_BATCH = 64
CONSUMER_IDLE_S = 30.0  # a read's consumer left behind (its delete lost) goes after this
CHUNK_BYTES = 128 * 1024  # nats-py's chunk size, well under any server's max_payload


@dataclass(frozen=True)
class ObjectEntry:
    name: str
    size: int
    mtime: str  # when it was put (ISO 8601, UTC)
    writer: str = ""  # who put it (``put(writer=...)``; "" when unknown)


class ObjectStore:
    """A JetStream Object Store bucket for multi-MiB objects. ``open`` creates it when missing."""

    def __init__(self, store: NatsObjectStore, js: JetStreamContext, name: str) -> None:
        self._store = store
        self._js = js
        self.name = name
        self._stream = f"OBJ_{name}"
        self._orphans: set[str] = set()  # chunk subjects of cut-short puts still to purge
        self._purges: set[asyncio.Task[None]] = set()

    @classmethod
    async def open(cls, bus: NatsBus, name: str, *, timeout: float = 10.0) -> ObjectStore:
        js = bus.client.jetstream(timeout=timeout)
        try:
            store = await js.object_store(name)
        except nats.js.errors.BucketNotFoundError:
            store = await js.create_object_store(name)
        return cls(store, js, name)

    @property
    def num_orphans(self) -> int:
        """Chunk subjects of cut-short puts not purged yet (the server could not be reached)."""
        return len(self._orphans)

    async def put(self, name: str, data: bytes, *, writer: str = "") -> None:
        """Store ``data`` as ``name`` (replacing an object of that name), recording ``writer``.
        Cut short (an error, a timeout, a cancellation), it leaves no chunk of it behind."""
        await self._purge_orphans()
        try:
            old = await self._store.get_info(name)
        except nats.js.errors.ObjectNotFoundError:
            old = None
        nuid = uuid.uuid4().hex
        chunks = f"$O.{self.name}.C.{nuid}"
        try:
            digest = await asyncio.to_thread(hashlib.sha256, data)
            for start in range(0, len(data), CHUNK_BYTES):
                await self._js.publish(chunks, data[start : start + CHUNK_BYTES])
            info = api.ObjectInfo(
                name=name,
                bucket=self.name,
                nuid=nuid,
                size=len(data),
                chunks=-(-len(data) // CHUNK_BYTES),
                mtime=datetime.now(UTC).isoformat(),
                digest="SHA-256=" + base64.urlsafe_b64encode(digest.digest()).decode(),
                description=writer or None,
                options=api.ObjectMetaOptions(max_chunk_size=CHUNK_BYTES),
            )
            await self._js.publish(
                self._meta_subject(name),
                json.dumps(info.as_dict()).encode(),
                headers={api.Header.ROLLUP: "sub"},
            )
        except BaseException:
            self._purge_soon(chunks)
            raise
        if old is not None and old.nuid and not old.deleted:
            self._purge_soon(f"$O.{self.name}.C.{old.nuid}")  # the replaced object's chunks

    async def delete(self, name: str) -> bool:
        """Remove an object; whether it was there. The delete marker nats-py leaves in the
        bucket's metadata is purged too, so deleted names do not pile up in every ``list``."""
        try:
            await self._store.delete(name)
        except nats.js.errors.ObjectNotFoundError:
            return False
        await self._js.purge_stream(self._stream, subject=self._meta_subject(name))
        return True

    async def info(self, name: str) -> ObjectEntry | None:
        """The object's entry (None if missing or deleted): one request to the server."""
        try:
            info = await self._store.get_info(name)
        except nats.js.errors.ObjectNotFoundError:
            return None
        return _entry(info)

    async def list(self) -> list[ObjectEntry]:
        """The objects held (deleted ones left out), oldest put first."""
        try:
            infos = await self._store.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []
        entries = [_entry(i) for i in infos if i.name]
        return sorted(entries, key=lambda e: e.mtime)  # ISO-8601 UTC stamps sort as text

    async def get(self, name: str, *, timeout: float = 10.0) -> bytes | bytearray | None:
        """The object's bytes (None if missing), read with a pull consumer and checked
        against its SHA-256 digest (in a thread: the loop is never held by a large object);
        ``PayloadIntegrityError`` if they do not match or some of its chunks are gone."""
        try:
            info = await self._store.get_info(name)
        except nats.js.errors.ObjectNotFoundError:
            return None
        size, num_chunks = info.size or 0, info.chunks or 0
        if size == 0:
            return b""
        consumer = uuid.uuid4().hex
        config = api.ConsumerConfig(
            name=consumer,
            filter_subject=f"$O.{self.name}.C.{info.nuid}",
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.ALL,
            inactive_threshold=CONSUMER_IDLE_S,  # the server's clean-up if ours never runs
        )
        created = await self._js.add_consumer(self._stream, config=config)
        try:
            if (created.num_pending or 0) < num_chunks:  # purged or never complete: fail now
                raise PayloadIntegrityError(
                    f"object {name!r}: {created.num_pending or 0} of {num_chunks} chunks"
                )
            buffer = await self._fetch(name, consumer, size, num_chunks, timeout)
        finally:  # one consumer per read: a stream holds a bounded number of them
            self._delete_consumer_soon(consumer)
        await asyncio.to_thread(_check_digest, name, buffer, info.digest or "")
        return buffer

    async def _fetch(
        self, name: str, consumer: str, size: int, num_chunks: int, timeout: float
    ) -> bytearray:
        sub = await self._js.pull_subscribe_bind(consumer, stream=self._stream)
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
        return buffer

    def _delete_consumer_soon(self, consumer: str) -> None:
        """Delete a read's consumer in a task of its own (a cancelled read does not wait)."""
        task = asyncio.get_running_loop().create_task(self._delete_consumer(consumer))
        self._purges.add(task)
        task.add_done_callback(self._purges.discard)

    async def _delete_consumer(self, consumer: str) -> None:
        try:
            await self._js.delete_consumer(self._stream, consumer)
        except Exception:  # unreachable now: the server drops it once idle
            return

    # -- helpers --------------------------------------------------------------------------------

    def _meta_subject(self, name: str) -> str:
        return f"$O.{self.name}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"

    def _purge_soon(self, subject: str) -> None:
        """Purge ``subject`` in a task of its own (a cancelled put does not wait for it); if the
        server cannot be reached it stays an orphan, purged by the next ``put``."""
        self._orphans.add(subject)
        task = asyncio.get_running_loop().create_task(self._purge(subject))
        self._purges.add(task)
        task.add_done_callback(self._purges.discard)

    async def _purge_orphans(self) -> None:
        for subject in list(self._orphans):
            await self._purge(subject)

    async def _purge(self, subject: str) -> None:
        try:
            await self._js.purge_stream(self._stream, subject=subject)
        except Exception:  # unreachable now: left for the next put
            return
        self._orphans.discard(subject)


def _entry(info: api.ObjectInfo) -> ObjectEntry:
    return ObjectEntry(info.name, info.size or 0, info.mtime or "", info.description or "")


def _check_digest(name: str, data: bytearray, digest: str) -> None:
    expected = digest.split("=", 1)[-1]
    actual = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
    if expected.rstrip("=") != actual.rstrip("="):
        raise PayloadIntegrityError(f"object {name!r}: digest mismatch")
