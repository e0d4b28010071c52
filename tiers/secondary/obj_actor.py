"""The object-store tier actor: a secondary tier behind a CPU tier, on the bus's object store
(``Bus.open_object_store``: the JetStream Object Store of the deployment's NATS, or the
in-memory broker's own), so chunks outlive every engine core and this actor, and one host's
tier finds what another host's tier put in the same bucket.

Chunks are objects (``tiers.secondary.obj_store.ObjectChunks``) in ``ObjTierConfig.bucket`` (default
``shoal_kv_<namespace>``), one per tensor-parallel rank; the protocol, the LRU index within
``bytes_to_use``, the cascade queue and the deadlines are every secondary tier's
(``tiers.secondary.actor``). At attach the index is rebuilt from the bucket's listing (oldest
put first); a lookup that the index does not answer in full asks the store for the keys past
it (``ObjectChunks.probe``, bounded by ``probe_timeout_s``; ``plan_tiers`` gives it an eighth
of ``kv_lookup_timeout_s``, half the CPU tier's wait for one secondary) and adopts what another
host put.

The byte budget is this tier's: the index holds at most ``bytes_to_use`` of chunks, its own
(written by it, under its actor id: a restarted tier owns its predecessor's) and foreign ones
(found at attach or adopted by a lookup). Past the budget the least recently used leave: an own
chunk's objects are deleted, a foreign one is only forgotten (its writer's budget deletes it),
so no tier deletes another host's fresh objects because the bucket holds more than its own
budget. A damaged object is removed whoever wrote it. Whether a chunk that leaves is deleted or
forgotten is decided as it leaves; the deletes caused by a lookup's adoption then run behind the
cascades (the write lock), so a delete never races a rewrite of the same key (and a layout
switch meanwhile does not make another host's chunk look like this tier's).

A bucket that cannot be opened (a NATS server without JetStream) refuses the attach. At most
``max_concurrent_io`` chunks are read and as many written at once (apart: a promote never waits
behind a cascade's puts);
a read waits for the store only until its job's deadline, and a cascade whose deadline passes
while one of its keys is on the wire waits for that key (its copy into or out of the slot
happens only before the deadline). Stopped, it waits a moment for its object store's purges
and consumer deletes still running (``ObjectStore.close``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from shoal.bus.base import Bus
from shoal.bus.buckets import ObjectStore
from shoal.bus.messages.offload import KVLayout
from shoal.config.deployment import ObjTierConfig
from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.books.manager import OffloadManager
from shoal.tiers.secondary.actor import ChunkIO, SecondaryTierActor, TierUnavailable
from shoal.tiers.secondary.chunk_format import CorruptChunk, DeadlinePassed
from shoal.tiers.secondary.obj_store import FoundChunk, ObjectChunks, TierStoreError, default_bucket

log = logging.getLogger(__name__)


class ObjTierActor(SecondaryTierActor[ObjectChunks]):
    """An object-store tier (``ObjTierConfig``) reached on ``subjects.tier_in(actor_id)``."""

    medium = "obj"

    def __init__(
        self,
        bus: Bus,
        actor_id: str,
        *,
        tier_config: ObjTierConfig,
        max_concurrent_io: int = 4,
        io_timeout_s: float = 10.0,
        probe_timeout_s: float = 0.25,  # plan_tiers passes kv_lookup_timeout_s / 8
        **options: Any,  # SecondaryTierActor's: namespace, jetstream_replicas (plan_tiers: the
        # config's), kv_events_snapshot_interval_s, max_queued_cascades, keep_regions, ...
    ) -> None:
        super().__init__(bus, actor_id, bytes_to_use=tier_config.bytes_to_use, **options)
        if max_concurrent_io < 1 or io_timeout_s <= 0 or probe_timeout_s <= 0:
            raise ValueError("max_concurrent_io must be >= 1, the timeouts positive")
        self.tier_config = tier_config
        self.bucket = tier_config.bucket or default_bucket(self.subjects.namespace)
        self.io_timeout_s = io_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.foreign: set[OffloadKey] = set()  # indexed chunks another tier wrote
        self.num_chunks_adopted = 0  # found by lookups in the store
        self.num_chunks_forgotten = 0  # foreign chunks past the budget (left in the store)
        self.num_probe_failures = 0  # lookups whose probe of the store failed or timed out
        self._evictions: set[asyncio.Task[None]] = set()
        # reads and writes queue apart: a promote never waits behind a long cascade's puts
        self._io_slots = {
            "read": asyncio.Semaphore(max_concurrent_io),
            "write": asyncio.Semaphore(max_concurrent_io),
        }
        self._objects: ObjectStore | None = None

    def load(self) -> dict[str, float]:
        figures = super().load()
        figures["num_chunks_adopted"] = float(self.num_chunks_adopted)
        figures["num_chunks_forgotten"] = float(self.num_chunks_forgotten)
        figures["num_probe_failures"] = float(self.num_probe_failures)
        return figures

    async def on_stop(self) -> None:
        for task in list(self._evictions):
            task.cancel()  # an own object left in the bucket is found again at the next attach
        if self._objects is not None:
            await self._objects.close()  # its purges and consumer deletes, within a bound
        await super().on_stop()

    async def _open(self, layout: KVLayout) -> tuple[ObjectChunks, list[OffloadKey]]:
        try:
            if self._objects is None:
                self._objects = await self.bus.open_object_store(
                    self.bucket, replicas=self.jetstream_replicas
                )
            chunks = ObjectChunks(
                self._objects, layout, writer=self.actor_id, timeout_s=self.io_timeout_s
            )
            found = await chunks.scan()
        except TierStoreError as exc:
            raise TierUnavailable(str(exc)) from exc
        except Exception as exc:  # the NATS client's own errors (only bus/ may name them)
            raise TierUnavailable(f"bucket {self.bucket}: {type(exc).__name__}: {exc}") from exc
        self.foreign = {key for key, is_own in found if not is_own}
        return chunks, [key for key, _ in found]

    # -- lookups past the index -----------------------------------------------------------------

    async def _lookup(self, keys: Sequence[OffloadKey]) -> int:
        num = self._num_leading_ready(keys)
        store, index = self.store, self.index
        if num == len(keys) or store is None or index is None or keys[num] in index.chunks:
            return num  # all held, not attached, or the next one is being written here
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                found = await store.probe(keys[num : index.num_slots])  # what the budget holds
        except (TierStoreError, TimeoutError) as exc:
            self.num_probe_failures += 1
            log.debug("%r: probe failed: %s", self, exc)
            return num
        if found and self.store is store and self.index is index:
            held = [key for key in keys[:num] if key in index.chunks]  # a cascade may evict
            self._adopt(store, index, held, found)
        return self._num_leading_ready(keys)

    def _adopt(
        self,
        store: ObjectChunks,
        index: OffloadManager,
        held: Sequence[OffloadKey],
        found: list[FoundChunk],
    ) -> None:
        """Index ``found`` (most recent) after ``held``, which stay; the chunks that leave for
        the budget are evicted in the background, behind the cascades."""
        out = index.prepare_store([*held, *(key for key, _ in found)], filtered=False)
        if out is None:  # no room: every chunk held is being read
            return
        new = set(out.keys_to_store)
        self.foreign.update(key for key, is_own in found if key in new and not is_own)
        index.complete_store(out.keys_to_store)
        self.num_chunks_adopted += len(new)
        own = self._forget_foreign(out.evicted_keys)  # decided now: a layout switch replaces
        if own:  # ``foreign`` before the task runs
            task = asyncio.create_task(self._evict_behind_writes(store, index, own))
            self._evictions.add(task)
            task.add_done_callback(self._evictions.discard)

    async def _evict_behind_writes(
        self, store: ObjectChunks, index: OffloadManager, own: Sequence[OffloadKey]
    ) -> None:
        """Delete ``own`` chunks once the cascades before have run, but not one that a cascade
        stored or a lookup adopted again meanwhile (its object is live)."""
        async with self._write_lock:
            await super()._evict(store, [key for key in own if key not in index.chunks])

    async def _evict(self, store: ObjectChunks, keys: Sequence[OffloadKey]) -> None:
        """Past the budget: this tier's own chunks deleted, foreign ones only forgotten."""
        await super()._evict(store, self._forget_foreign(keys))

    def _forget_foreign(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Forget the foreign ``keys`` (left in the store); the own ones, which go."""
        foreign = {key for key in keys if key in self.foreign}
        self.foreign -= foreign
        self.num_chunks_forgotten += len(foreign)
        return [key for key in keys if key not in foreign]

    # -- chunk I/O ------------------------------------------------------------------------------

    async def _store_chunk(self, store: ObjectChunks, io: ChunkIO) -> Exception | None:
        move = lambda slot: store.write_chunk(io.key, slot, io.deadline)  # noqa: E731
        error = await self._on_slot(io, "write", move)
        if error is None:
            self.foreign.discard(io.key)  # written by this tier now
        return error

    async def _load_chunk(self, store: ObjectChunks, io: ChunkIO) -> Exception | None:
        move = lambda slot: store.read_chunk(io.key, slot, io.deadline)  # noqa: E731
        error = await self._on_slot(io, "read", move)
        if isinstance(error, CorruptChunk):
            self.foreign.discard(io.key)  # removed from the store and the index
        return error

    async def _delete_chunks(self, store: ObjectChunks, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            try:
                await store.delete(key)
            except TierStoreError as exc:
                log.warning("obj tier: chunk %s not removed: %s", key.hex(), exc)

    async def _on_slot(
        self, io: ChunkIO, kind: str, move: Callable[[memoryview], Awaitable[None]]
    ) -> Exception | None:
        """``move(slot)`` when an I/O slot of ``kind`` (read, write) is free; its error (None:
        done), logged unless it is a deadline's."""
        async with self._io_slots[kind]:
            try:
                with io.region.slot(io.slot_id) as slot:
                    await move(slot)
            except DeadlinePassed as exc:
                return exc.with_traceback(None)
            except CorruptChunk as exc:
                log.warning("obj tier: %s (removed)", exc)
                return exc.with_traceback(None)
            except (TierStoreError, ValueError, IndexError, OSError) as exc:
                log.warning("obj tier: chunk %s: %s", io.key.hex(), exc)
                return exc.with_traceback(None)  # its frames would keep the slot's view alive
        return None
