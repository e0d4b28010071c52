"""The object-store tier actor: a secondary tier behind a CPU tier, on the JetStream Object
Store of the deployment's NATS, so chunks outlive every engine core and this actor (another
host's puts are seen at the next attach only: ``docs/kv-offload.md``, Limits).

Chunks are objects (``tiers.obj_store.ObjectChunks``) in ``ObjTierConfig.bucket`` (default
``shoal_kv_<namespace>``), one per tensor-parallel rank; the protocol, the LRU index within
``bytes_to_use`` (objects past it deleted), the cascade queue and the deadlines are every
secondary tier's (``tiers.secondary_actor``). The bucket outlives every engine core and this
actor: at attach the index is rebuilt from the bucket's listing (oldest put first).

It needs a NATS bus (on another bus an attach is refused). At most ``max_concurrent_io`` chunks
are read and as many written at once (apart: a promote never waits behind a cascade's puts);
a job whose deadline passes while one of its keys is on the wire waits for that
key (its copy into or out of the slot happens only before the deadline).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from shoal.bus.base import Bus
from shoal.bus.jetstream import ObjectStore
from shoal.bus.messages.config import ObjTierConfig
from shoal.bus.messages.offload import KVLayout
from shoal.bus.nats_bus import NatsBus
from shoal.tiers.chunk_format import CorruptChunk, DeadlinePassed
from shoal.tiers.keys import OffloadKey
from shoal.tiers.obj_store import ObjectChunks, TierStoreError, default_bucket
from shoal.tiers.secondary_actor import ChunkIO, SecondaryTierActor, TierUnavailable

log = logging.getLogger(__name__)


class ObjTierActor(SecondaryTierActor[ObjectChunks]):
    """An object-store tier (``ObjTierConfig``) reached on ``subjects.tier_in(actor_id)``."""

    def __init__(
        self,
        bus: Bus,
        actor_id: str,
        *,
        tier_config: ObjTierConfig,
        max_concurrent_io: int = 4,
        io_timeout_s: float = 10.0,
        **options: Any,  # SecondaryTierActor's: namespace, max_queued_cascades, keep_regions, ...
    ) -> None:
        super().__init__(bus, actor_id, bytes_to_use=tier_config.bytes_to_use, **options)
        if max_concurrent_io < 1 or io_timeout_s <= 0:
            raise ValueError("max_concurrent_io must be >= 1 and io_timeout_s positive")
        self.tier_config = tier_config
        self.bucket = tier_config.bucket or default_bucket(self.subjects.namespace)
        self.io_timeout_s = io_timeout_s
        # reads and writes queue apart: a promote never waits behind a long cascade's puts
        self._io_slots = {
            "read": asyncio.Semaphore(max_concurrent_io),
            "write": asyncio.Semaphore(max_concurrent_io),
        }
        self._objects: ObjectStore | None = None

    async def _open(self, layout: KVLayout) -> tuple[ObjectChunks, list[OffloadKey]]:
        if not isinstance(self.bus, NatsBus):
            raise TierUnavailable("the object tier needs a NATS bus")
        try:
            if self._objects is None:
                self._objects = await ObjectStore.open(self.bus, self.bucket)
            chunks = ObjectChunks(self._objects, layout, timeout_s=self.io_timeout_s)
            return chunks, await chunks.scan()
        except TierStoreError as exc:
            raise TierUnavailable(str(exc)) from exc
        except Exception as exc:  # the NATS client's own errors (only bus/ may name them)
            raise TierUnavailable(f"bucket {self.bucket}: {type(exc).__name__}: {exc}") from exc

    def _store_chunk(self, store: ObjectChunks, io: ChunkIO) -> Awaitable[Exception | None]:
        move = lambda slot: store.write_chunk(io.key, slot, io.deadline)  # noqa: E731
        return self._on_slot(io, "write", move)

    def _load_chunk(self, store: ObjectChunks, io: ChunkIO) -> Awaitable[Exception | None]:
        move = lambda slot: store.read_chunk(io.key, slot, io.deadline)  # noqa: E731
        return self._on_slot(io, "read", move)

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
