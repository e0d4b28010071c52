"""The JetStream Object Store on a ``NatsBus`` (``NatsBus.open_object_store``): a
``NatsObjectStore`` (``bus.buckets.ObjectStore`` on NATS) whose ``get`` reads chunks into one
buffer (nats-py's own ``get`` concatenates bytes chunk by chunk, which is slow for multi-MiB
objects) by direct gets, one request per chunk that any replica answers, ``DIRECT_READS`` reads
at once per store (no consumer: 512 objects of 196 KiB read at once on a 2-core machine went
from 0.04 GB/s with a consumer per read to 0.14-0.19 GB/s). A chunk a direct get does not find
(a replica behind the leader, or purged) sends the read to a pull consumer of its own,
leader-consistent, in short pulls: a read whose chunks are purged under it fails at once, not
at its timeout.

The ``put`` is shoal's own, in nats-py's format (objects stay readable by any NATS client): it
records who wrote an object (the meta's ``description``), digests in a thread, and leaves no
chunk messages behind when it is cut short, also by a cancellation (nats-py purges them only on
an ``Exception``): they are purged then, or by a later ``put`` if the server could not be
reached. Several clients may put, read and delete one name at once (hosts sharing a bucket):
a meta is published only over the one its put read (the first of overlapping puts wins, the
others purge their chunks), a delete purges only the meta it read and older ones, and a read
that finds its object put again meanwhile is a miss. ``close`` waits for the purges and
consumer deletes still running."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.object_store import ObjectStore as NatsPyObjectStore

from shoal.bus.buckets import ObjectEntry, ObjectStore
from shoal.bus.errors import BusTimeoutError, PayloadIntegrityError
from shoal.bus.jetstream.create import open_guarded
from shoal.bus.transport.nats_connected import NatsConnectedBus

FETCH_BATCH = 64
FETCH_WAIT_S = 0.25  # one pull's wait: after an empty one the consumer is asked what is left
WRONG_LAST_SEQUENCE = 10071  # the server's error code: an expected last sequence did not hold
PUBLISH_TRIES = 3  # of a put's meta, while the name's meta is deleted under it
CONSUMER_IDLE_S = 30.0  # a read's consumer left behind (its delete lost) goes after this
CHUNK_BYTES = 128 * 1024  # nats-py's chunk size, well under any server's max_payload
# Reads by direct gets at once per store, each with one chunk on its way: 8 MiB queued to this
# client at most (a server drops a client with more than its max_pending, 64 MiB by default).
DIRECT_READS = 64


@dataclass(frozen=True)
class _Meta:
    """An object's meta message: its stream sequence and what it says."""

    seq: int
    info: api.ObjectInfo

    @property
    def is_live(self) -> bool:
        return bool(self.info.nuid) and not self.info.deleted


class _ChunksGone(Exception):
    """A read found fewer chunk messages than the object's meta names (purged, or replaced)."""


class NatsObjectStore(ObjectStore):
    """A JetStream Object Store bucket for multi-MiB objects. ``open`` creates it when missing."""

    def __init__(self, store: NatsPyObjectStore, js: JetStreamContext, name: str) -> None:
        self._store = store
        self._js = js
        self.name = name
        self._stream = f"OBJ_{name}"
        self._orphans: set[str] = set()  # chunk subjects of cut-short puts still to purge
        self._purges: set[asyncio.Task[None]] = set()  # purges, consumer deletes, watcher stops
        self._direct_reads = asyncio.Semaphore(DIRECT_READS)

    @classmethod
    async def open(
        cls, bus: NatsConnectedBus, name: str, *, replicas: int = 1, timeout: float = 10.0
    ) -> NatsObjectStore:
        """Open (or create, with ``replicas`` copies in a cluster) bucket ``name``."""
        js = bus.client.jetstream(timeout=timeout)
        opening = _open_store(js, name, replicas)
        store = await open_guarded(bus, f"OBJ_{name}", f"object bucket {name!r}", opening)
        return cls(store, js, name)

    @property
    def num_orphans(self) -> int:
        """Chunk subjects of cut-short puts not purged yet (the server could not be reached)."""
        return len(self._orphans)

    async def close(self, timeout: float = 1.0) -> None:
        """Wait at most ``timeout`` for the purges and consumer deletes still running; cancel
        those left (a chunk subject not purged stays an orphan, a consumer goes once idle)."""
        tasks = set(self._purges)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def put(self, name: str, data: bytes, *, writer: str = "") -> bool:
        """Store ``data`` as ``name`` (replacing an object of that name), recording ``writer``.
        Cut short (an error, a timeout, a cancellation), it leaves no chunk of it behind.

        The meta is published only if the name's meta is still the one read before the chunks
        (``Nats-Expected-Last-Subject-Sequence``): of overlapping puts of one name the first to
        publish wins, and a loser purges its own chunks and returns False (the caller's objects
        of one name hold the same bytes, so the winner's object serves it). A name deleted
        meanwhile is no winner: the put publishes again."""
        await self._purge_orphans()
        last = await self._last_meta(name)
        nuid = uuid.uuid4().hex
        chunks = self._chunk_subject(nuid)
        try:
            digest = await asyncio.to_thread(hashlib.sha256, data)
            for start in range(0, len(data), CHUNK_BYTES):
                await self._js.publish(chunks, data[start : start + CHUNK_BYTES])
            info = _object_info(self.name, name, nuid, data, digest, writer)
            stored, replaced = await self._publish_meta(info, last)
        except BaseException:
            self._purge_soon(chunks)
            raise
        if not stored:
            self._purge_soon(chunks)  # another put of the name published first: its object stays
        elif replaced is not None and replaced.is_live:
            self._purge_soon(self._chunk_subject(replaced.info.nuid))
        return stored

    async def _publish_meta(
        self, info: api.ObjectInfo, last: _Meta | None
    ) -> tuple[bool, _Meta | None]:
        """Publish ``info`` as its name's meta if ``last`` is still the latest one; whether it
        was, and the meta it replaced. Refused because the name was deleted since, it tries
        again (``PUBLISH_TRIES`` in all); because another put published, it gives up."""
        for _ in range(PUBLISH_TRIES):
            try:
                await self._js.publish(
                    self._meta_subject(info.name),
                    json.dumps(info.as_dict()).encode(),
                    headers={
                        api.Header.ROLLUP: "sub",
                        api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(last.seq if last else 0),
                    },
                )
                return True, last
            except nats.js.errors.APIError as exc:
                if exc.err_code != WRONG_LAST_SEQUENCE:
                    raise
            last = await self._last_meta(info.name)
            if last is not None and last.is_live:
                break
        return False, last

    async def delete(self, name: str) -> bool:
        """Remove an object; whether it was there. Its chunks are purged, then its meta and
        older ones (no delete marker: deleted names do not pile up in every ``list``), so a
        put of the name that lands meanwhile keeps its newer meta (nats-py's delete would
        overwrite it with a marker)."""
        meta = await self._last_meta(name)
        if meta is None:
            return False
        if meta.is_live:
            await self._js.purge_stream(self._stream, subject=self._chunk_subject(meta.info.nuid))
        await self._js.purge_stream(
            self._stream, subject=self._meta_subject(name), seq=meta.seq + 1
        )
        return meta.is_live

    async def info(self, name: str) -> ObjectEntry | None:
        """The object's entry (None if missing or deleted): one request to the server."""
        meta = await self._last_meta(name)
        return _entry(meta.info) if meta is not None and meta.is_live else None

    async def list(self) -> list[ObjectEntry]:
        """The objects held (deleted ones left out), oldest put first. Cut short (a timeout, a
        cancellation), its watcher (a subscription and its consumer) is stopped all the same."""
        try:
            watcher = await self._watch()
        except nats.js.errors.NotFoundError:  # no such stream (any more)
            return []
        try:
            infos = []
            async for info in watcher:
                if info is None:  # the marker "caught up with existing objects"
                    break
                infos.append(info)
        finally:
            await watcher.stop()
        entries = [_entry(i) for i in infos if i.name]
        return sorted(entries, key=lambda e: e.mtime)  # ISO-8601 UTC stamps sort as text

    async def get(self, name: str, *, timeout: float = 10.0) -> bytes | bytearray | None:
        """The object's bytes (None if missing) within ``timeout`` (``BusTimeoutError``),
        checked against its SHA-256 digest (in a thread: the loop is never held by a large
        object); ``PayloadIntegrityError`` if they do not match or some of its chunks are gone,
        found at once (not at the timeout) also while it is read. None as well if the object was
        deleted or replaced since the read began (a miss: the name's new object is left alone).

        The meta is the stream leader's; the chunks come by direct gets, which any replica may
        answer. One that lags the leader may lack a chunk the meta names, so a chunk not found
        is never called damaged on that alone: the chunks are read again through a consumer
        (the leader's view), and only what that read finds decides."""
        meta = await self._last_meta(name)
        if meta is None or not meta.is_live:
            return None
        info = meta.info
        if not info.size:
            return b""
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            buffer = await self._read_direct(name, info, timeout)
            if buffer is None:  # a replica behind the leader, or chunks gone: the leader says
                left = max(deadline - asyncio.get_running_loop().time(), 0.0)
                buffer = await self._read_chunks(name, info, left)
        except _ChunksGone as exc:
            now = await self._last_meta(name)
            if now is None or not now.is_live or now.info.nuid != info.nuid:
                return None
            raise PayloadIntegrityError(f"object {name!r}: {exc}") from None
        await asyncio.to_thread(_check_digest, name, buffer, info.digest or "")
        return buffer

    # -- reads ----------------------------------------------------------------------------------

    async def _read_direct(
        self, name: str, info: api.ObjectInfo, timeout: float
    ) -> bytearray | None:
        """The chunks of ``info`` by direct gets, in order (each asks for the chunk subject's
        next message past the last one read); None if one is not found, or the stream answers
        no direct gets (``allow_direct`` off), or the chunks hold too few bytes."""
        subject = self._chunk_subject(info.nuid or "")
        size, buffer, seq = info.size or 0, bytearray(), 0
        try:
            async with asyncio.timeout(timeout), self._direct_reads:
                for _ in range(info.chunks or 0):
                    msg = await self._js.get_msg(
                        self._stream, seq=seq, subject=subject, direct=True, next=True
                    )
                    buffer += msg.data or b""
                    seq = (msg.seq or 0) + 1
        except (nats.js.errors.NotFoundError, nats.errors.NoRespondersError):
            return None
        except TimeoutError:
            raise BusTimeoutError(f"object {name!r}: {len(buffer)}/{size} bytes") from None
        return buffer if len(buffer) >= size else None

    async def _read_chunks(self, name: str, info: api.ObjectInfo, timeout: float) -> bytearray:
        """The chunks of ``info`` through a consumer of this read's own (the stream leader's
        view; deleted after it, also when cut short while it is created); ``_ChunksGone`` if
        some are not in the stream."""
        consumer = uuid.uuid4().hex
        config = api.ConsumerConfig(
            name=consumer,
            filter_subject=self._chunk_subject(info.nuid or ""),
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.ALL,
            inactive_threshold=CONSUMER_IDLE_S,  # the server's clean-up if ours never runs
        )
        num_chunks = info.chunks or 0
        try:  # one consumer per read: a stream holds a bounded number of them
            created = await self._js.add_consumer(self._stream, config=config)
            if (created.num_pending or 0) < num_chunks:  # purged or never complete: fail now
                raise _ChunksGone(f"{created.num_pending or 0} of {num_chunks} chunks")
            return await self._fetch(name, consumer, info.size or 0, num_chunks, timeout)
        finally:
            self._delete_consumer_soon(consumer)

    async def _fetch(
        self, name: str, consumer: str, size: int, num_chunks: int, timeout: float
    ) -> bytearray:
        """Pull ``size`` bytes in ``num_chunks`` messages, each pull waiting ``FETCH_WAIT_S`` at
        most: after one that brought nothing, the consumer is asked, and a read left with
        nothing to come (its chunks purged) is ``_ChunksGone`` at once."""
        sub = await self._js.pull_subscribe_bind(consumer, stream=self._stream)
        buffer, received = bytearray(), 0
        try:
            async with asyncio.timeout(timeout):
                while len(buffer) < size:
                    if received >= num_chunks:
                        raise _ChunksGone(f"{num_chunks} chunks hold {len(buffer)} bytes")
                    try:
                        batch = min(FETCH_BATCH, num_chunks - received)
                        msgs = await sub.fetch(batch=batch, timeout=FETCH_WAIT_S)
                    except TimeoutError:  # nats-py's: no message within the wait
                        msgs = []
                    for msg in msgs:
                        buffer += msg.data
                    received += len(msgs)
                    if not msgs and await _nothing_to_come(sub, received):
                        raise _ChunksGone(f"{received} of {num_chunks} chunks")
        except TimeoutError:
            raise BusTimeoutError(f"object {name!r}: {len(buffer)}/{size} bytes") from None
        finally:
            await sub.unsubscribe()
        return buffer

    def _delete_consumer_soon(self, consumer: str) -> None:
        """Delete a read's consumer in a task of its own (a cancelled read does not wait); one
        that was never created is not found, which is fine."""
        self._track(self._delete_consumer(consumer))

    async def _delete_consumer(self, consumer: str) -> None:
        try:
            await self._js.delete_consumer(self._stream, consumer)
        except Exception:  # not found, or unreachable now: the server drops it once idle
            return

    # -- listing --------------------------------------------------------------------------------

    async def _watch(self) -> NatsPyObjectStore.ObjectWatcher:
        """nats-py's watcher of the live objects' metas. Opened in a task of its own: cut short
        while it opens, the watcher is stopped once it is open."""
        opening = asyncio.ensure_future(self._store.watch(ignore_deletes=True))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(self._stop_watcher_soon)
            raise

    def _stop_watcher_soon(self, opening: asyncio.Future[NatsPyObjectStore.ObjectWatcher]) -> None:
        if not opening.cancelled() and opening.exception() is None:
            self._track(opening.result().stop())

    # -- helpers --------------------------------------------------------------------------------

    async def _last_meta(self, name: str) -> _Meta | None:
        """The name's latest meta message (a live object's, or nats-py's delete marker)."""
        try:
            msg = await self._js.get_last_msg(self._stream, self._meta_subject(name))
        except nats.js.errors.NotFoundError:
            return None
        return _Meta(msg.seq or 0, api.ObjectInfo.from_response(json.loads(msg.data or b"{}")))

    def _meta_subject(self, name: str) -> str:
        return f"$O.{self.name}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"

    def _chunk_subject(self, nuid: str) -> str:
        return f"$O.{self.name}.C.{nuid}"

    def _track(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in a task of its own, kept until it is done (``close`` waits for it)."""
        task = asyncio.get_running_loop().create_task(work)
        self._purges.add(task)
        task.add_done_callback(self._purges.discard)

    def _purge_soon(self, subject: str) -> None:
        """Purge ``subject`` in a task of its own (a cancelled put does not wait for it); if the
        server cannot be reached it stays an orphan, purged by the next ``put``."""
        self._orphans.add(subject)
        self._track(self._purge(subject))

    async def _purge_orphans(self) -> None:
        for subject in list(self._orphans):
            await self._purge(subject)

    async def _purge(self, subject: str) -> None:
        try:
            await self._js.purge_stream(self._stream, subject=subject)
        except Exception:  # unreachable now: left for the next put
            return
        self._orphans.discard(subject)


async def _nothing_to_come(sub: JetStreamContext.PullSubscription, received: int) -> bool:
    """Whether a read's consumer has no message left to deliver and delivered no more than
    ``received`` (none on its way to this client)."""
    info = await sub.consumer_info()
    delivered = info.delivered.consumer_seq if info.delivered else 0
    return not info.num_pending and delivered <= received


def _object_info(
    bucket: str, name: str, nuid: str, data: bytes, digest: Any, writer: str
) -> api.ObjectInfo:
    """nats-py's meta of an object put as ``CHUNK_BYTES`` messages under ``nuid``."""
    return api.ObjectInfo(
        name=name,
        bucket=bucket,
        nuid=nuid,
        size=len(data),
        chunks=-(-len(data) // CHUNK_BYTES),
        mtime=datetime.now(UTC).isoformat(),
        digest="SHA-256=" + base64.urlsafe_b64encode(digest.digest()).decode(),
        description=writer or None,
        options=api.ObjectMetaOptions(max_chunk_size=CHUNK_BYTES),
    )


def _entry(info: api.ObjectInfo) -> ObjectEntry:
    return ObjectEntry(info.name, info.size or 0, info.mtime or "", info.description or "")


def _check_digest(name: str, data: bytearray, digest: str) -> None:
    expected = digest.split("=", 1)[-1]
    actual = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
    if expected.rstrip("=") != actual.rstrip("="):
        raise PayloadIntegrityError(f"object {name!r}: digest mismatch")


async def _open_store(js: JetStreamContext, name: str, replicas: int) -> NatsPyObjectStore:
    try:
        return await js.object_store(name)
    except nats.js.errors.BucketNotFoundError:
        config = api.ObjectStoreConfig(bucket=name, replicas=replicas)
        return await js.create_object_store(name, config=config)
