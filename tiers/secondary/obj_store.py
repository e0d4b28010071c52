"""The object-store tier's chunks: one object per tensor-parallel rank part of a chunk, in one
object store bucket (``bus.buckets.ObjectStore``: JetStream's on NATS) that any host of the
deployment can reach.

Name: ``<model dir>/<part dir>/<key hex>`` (the filesystem tier's path, without the fan-out
directory; ``fs_store.model_dir_name``, ``fs_store.part_dir_name``: ``tp<tp_size>_r<rank>``, or
``canonical`` for the one part of a canonical layout, whatever tensor-parallel size wrote it).
An object is a part as ``tiers.secondary.chunk_format`` lays it out (header, key, payload, the
payload's xxh3-128 digest); the object store checks its own SHA-256 digest as well. A read that
finds a
part missing (also its chunk messages purged while it reads: found at once), of another
format, key or length, or failing either digest raises ``CorruptChunk`` and removes every part
of that chunk; a part put again while it was read (another host stored the chunk too: same
bytes) is a miss that removes nothing. A write publishes its parts only if ``deadline``
(``time.time()``; 0.0: none) had not passed once the slot was copied; a read waits for the
store only until it (and at most the timeout) and copies into the slot only before it
(``DeadlinePassed``).

Async over ``bus.buckets.ObjectStore`` (on NATS, chunked reads through a pull consumer); the copies
and digests of a part run in a thread, so a large chunk never holds the event loop. Each object
records its writer (the tier actor's id): ``FoundChunk.is_own`` tells a tier the chunks it may
delete for its byte budget from those another host's tier wrote. ``scan`` lists the bucket: the
complete chunks of this layout, oldest put first (reads do not refresh an object's time, so
after a restart recency is the order of storing); of an incomplete chunk it removes the parts
this tier wrote, and another tier's only once older than ``STALE_PART_S`` (that tier may be
putting the parts now). ``probe`` asks the store, without a listing, which of a prefix's
chunks another host put since. A store that cannot be reached raises ``TierStoreError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Sequence
from datetime import UTC, datetime
from typing import NamedTuple, TypeVar

from shoal.bus.buckets import ObjectEntry, ObjectStore
from shoal.bus.errors import BusError, PayloadIntegrityError
from shoal.bus.messages.offload import KVLayout
from shoal.bus.subjects import Subjects
from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.secondary.chunk_format import (
    CorruptChunk,
    check_deadline,
    check_head,
    head_size,
    pack_head,
    payload_digest,
)
from shoal.tiers.secondary.fs_store import is_key_hex, model_dir_name, part_dir_name

T = TypeVar("T")
PROBE_BATCH = 64  # keys asked at once by ``probe`` after its first one was found
STALE_PART_S = 600.0  # a part of an incomplete chunk this old is removed whoever wrote it


class FoundChunk(NamedTuple):
    """A complete chunk in the store, and whether this tier wrote every part of it."""

    key: OffloadKey
    is_own: bool


class TierStoreError(Exception):
    """The object store did not do what was asked (unreachable, timed out, refused)."""


def default_bucket(namespace: str) -> str:
    """The bucket of a deployment's object tier: ``shoal_kv_<namespace>``, made a valid name."""
    return Subjects(namespace).object_bucket()


class ObjectChunks:
    """The chunk objects of one layout in ``store``."""

    def __init__(
        self, store: ObjectStore, layout: KVLayout, *, writer: str = "", timeout_s: float = 10.0
    ) -> None:
        self.store = store
        self.layout = layout
        self.writer = writer  # recorded in every object put, to tell this tier's own apart
        self.timeout_s = timeout_s
        self.prefix = f"{model_dir_name(layout.model_tag)}/"
        self.part_dirs = [part_dir_name(layout, rank) for rank in range(layout.tp_size)]

    def name(self, key: OffloadKey, rank: int) -> str:
        return f"{self.prefix}{self.part_dirs[rank]}/{key.hex()}"

    async def write_chunk(self, key: OffloadKey, slot: memoryview, deadline: float = 0.0) -> None:
        """Store every rank part of a slot; on an error no part of the chunk is left.
        ``DeadlinePassed`` before the slot is copied, or after and before anything is put."""
        self._check_slot(slot)
        check_deadline(key, deadline)
        parts = await asyncio.to_thread(self._pack_parts, key, slot)
        check_deadline(key, deadline)  # the slot may have been reused while it was copied
        try:
            for rank, part in enumerate(parts):
                await self._call(self.store.put(self.name(key, rank), part, writer=self.writer))
        except BaseException:
            with contextlib.suppress(TierStoreError):
                await asyncio.shield(self.delete(key))
            raise

    async def read_chunk(self, key: OffloadKey, slot: memoryview, deadline: float = 0.0) -> None:
        """Read every rank part into a slot; ``CorruptChunk`` (and the chunk's objects removed)
        if any is missing or wrong; ``DeadlinePassed`` (the slot untouched) past ``deadline``."""
        self._check_slot(slot)
        check_deadline(key, deadline)
        try:
            parts = [await self._get_part(key, r, deadline) for r in range(self.layout.tp_size)]
            await asyncio.to_thread(self._check_parts, key, parts)
        except CorruptChunk:
            with contextlib.suppress(TierStoreError):
                await self.delete(key)
            raise
        await asyncio.to_thread(self._copy_parts, key, parts, slot, deadline)

    async def delete(self, key: OffloadKey) -> bool:
        """Remove every rank part of a chunk; whether any was there."""
        found = False
        for rank in range(self.layout.tp_size):
            found |= await self._call(self.store.delete(self.name(key, rank)))
        return found

    async def scan(self) -> list[FoundChunk]:
        """The complete chunks of this layout, oldest first. Of an incomplete chunk, the parts
        this tier wrote are removed, and others' only once older than ``STALE_PART_S`` (another
        host's tier may be putting that chunk's parts one after another now)."""
        parts: dict[str, list[ObjectEntry]] = {}
        for entry in await self._call(self.store.list()):
            part, _, name = entry.name.removeprefix(self.prefix).partition("/")
            if entry.name.startswith(self.prefix) and part in self.part_dirs and is_key_hex(name):
                parts.setdefault(name, []).append(entry)
        found, now = [], datetime.now(UTC)
        for name, entries in parts.items():
            if len(entries) == self.layout.tp_size:
                found.append((max(e.mtime for e in entries), name, self._is_own(entries)))
                continue
            for entry in entries:
                if self._is_own([entry]) or _age_s(entry, now) > STALE_PART_S:
                    await self._call(self.store.delete(entry.name))
        return [FoundChunk(bytes.fromhex(name), own) for _, name, own in sorted(found)]

    async def probe(self, keys: Sequence[OffloadKey]) -> list[FoundChunk]:
        """The leading ``keys`` whose every part is in the store now: the first key's parts
        asked alone (a miss costs one round trip), then ``PROBE_BATCH`` keys at a time while
        all are found. Nothing is read or removed."""
        found: list[FoundChunk] = []
        batch = 1
        while len(found) < len(keys):
            wanted = keys[len(found) : len(found) + batch]
            answers = await asyncio.gather(*(self._parts_info(key) for key in wanted))
            for key, entries in zip(wanted, answers, strict=True):
                if entries is None:
                    return found
                found.append(FoundChunk(key, self._is_own(entries)))
            batch = PROBE_BATCH
        return found

    # -- helpers --------------------------------------------------------------------------------

    async def _parts_info(self, key: OffloadKey) -> list[ObjectEntry] | None:
        """Every part's entry, or None if one is missing."""
        names = [self.name(key, rank) for rank in range(self.layout.tp_size)]
        entries = await asyncio.gather(*(self._call(self.store.info(n)) for n in names))
        return None if any(e is None for e in entries) else [e for e in entries if e is not None]

    def _is_own(self, entries: Sequence[ObjectEntry]) -> bool:
        return bool(self.writer) and all(e.writer == self.writer for e in entries)

    async def _get_part(self, key: OffloadKey, rank: int, deadline: float) -> bytes | bytearray:
        """A part's object, read within the timeout and before ``deadline`` (past it:
        ``DeadlinePassed``). ``CorruptChunk`` if it is missing or damaged, but not if it was
        put again while it was read (another host stored the chunk too): a miss, left alone."""
        name = self.name(key, rank)
        timeout = min(self.timeout_s, deadline - time.time()) if deadline else self.timeout_s
        try:
            check_deadline(key, deadline)
            part = await self._call(self.store.get(name, timeout=timeout), timeout)
        except PayloadIntegrityError:
            raise CorruptChunk(key, f"part {rank}: the object store's digest mismatch") from None
        except TierStoreError:
            check_deadline(key, deadline)  # it ran into the job's deadline: late, not failed
            raise
        if part is not None:
            return part
        if await self._call(self.store.info(name)) is not None:
            raise TierStoreError(f"chunk {key.hex()}: part {rank} was put again while read")
        raise CorruptChunk(key, f"part {rank} is missing")

    def _pack_parts(self, key: OffloadKey, slot: memoryview) -> list[bytes]:
        size = self.layout.rank_chunk_bytes
        parts = []
        for rank in range(self.layout.tp_size):
            payload = slot[rank * size : (rank + 1) * size]
            parts.append(pack_head(key, payload) + payload)
        return parts

    def _check_parts(self, key: OffloadKey, parts: list[bytes | bytearray]) -> None:
        start, size = head_size(key), self.layout.rank_chunk_bytes
        for rank, part in enumerate(parts):
            try:
                digest = check_head(part, key, size)
            except CorruptChunk as exc:
                raise CorruptChunk(key, f"part {rank}: {exc.reason}") from None
            if len(part) != start + size:
                raise CorruptChunk(key, f"part {rank}: not {size} payload bytes")
            if payload_digest(memoryview(part)[start:]) != digest:
                raise CorruptChunk(key, f"part {rank}: checksum mismatch")

    def _copy_parts(
        self, key: OffloadKey, parts: list[bytes | bytearray], slot: memoryview, deadline: float
    ) -> None:
        check_deadline(key, deadline)  # here, in the thread: never into a slot past it
        start, size = head_size(key), self.layout.rank_chunk_bytes
        for rank, part in enumerate(parts):
            slot[rank * size : (rank + 1) * size] = memoryview(part)[start:]

    def _check_slot(self, slot: memoryview) -> None:
        if len(slot) != self.layout.slot_bytes:
            raise ValueError(f"a slot of this layout is {self.layout.slot_bytes} bytes")

    async def _call(self, operation: Awaitable[T], timeout: float | None = None) -> T:
        """``operation`` within ``timeout`` (default: the tier's); a failure of the store is
        ``TierStoreError``."""
        try:
            async with asyncio.timeout(self.timeout_s if timeout is None else timeout):
                return await operation
        except PayloadIntegrityError:
            raise  # the object's bytes are wrong: the caller's CorruptChunk
        except (BusError, TimeoutError, OSError) as exc:
            raise TierStoreError(str(exc) or type(exc).__name__) from exc
        except Exception as exc:  # the NATS client's own errors (only bus/ may name them)
            raise TierStoreError(f"{type(exc).__name__}: {exc}") from exc


def _age_s(entry: ObjectEntry, now: datetime) -> float:
    """Seconds since the object was put (infinite if its time cannot be read)."""
    try:
        put_at = datetime.fromisoformat(entry.mtime)
    except ValueError:
        return math.inf
    if put_at.tzinfo is None:
        put_at = put_at.replace(tzinfo=UTC)
    return (now - put_at).total_seconds()
