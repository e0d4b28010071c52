"""The filesystem tier actor: a secondary tier behind a CPU tier on the same host.

It keeps chunks as files (``tiers.secondary.fs_store.ChunkFiles``) under ``FsTierConfig.path``, one
per tensor-parallel rank; the protocol, the LRU index within ``bytes_to_use``, the cascade queue and
the deadlines are every secondary tier's (``tiers.secondary.actor``). At attach the index is
rebuilt from the files (by mtime: least recently used first; leftover temp files removed).

File I/O runs in two small thread pools (writes, reads), so heartbeats, lookups and promotes go on
while a write is slow; a key's I/O already under way when a deadline passes is waited for (it
holds the region's mapping).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from shoal.bus.base import Bus
from shoal.bus.messages.offload import KVLayout
from shoal.config.deployment import FsTierConfig
from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.secondary.actor import ChunkIO, SecondaryTierActor, SecondaryTierCounters
from shoal.tiers.secondary.chunk_format import CorruptChunk, DeadlinePassed
from shoal.tiers.secondary.fs_store import ChunkFiles

log = logging.getLogger(__name__)

T = TypeVar("T")
FsTierCounters = SecondaryTierCounters


class FsTierActor(SecondaryTierActor[ChunkFiles]):
    """A filesystem tier (``FsTierConfig``) reached on ``subjects.tier_in(actor_id)``."""

    medium = "fs"

    def __init__(
        self,
        bus: Bus,
        actor_id: str,
        *,
        tier_config: FsTierConfig,
        num_io_threads: int = 4,
        **options: Any,  # SecondaryTierActor's: namespace, max_queued_cascades, keep_regions, ...
    ) -> None:
        super().__init__(bus, actor_id, bytes_to_use=tier_config.bytes_to_use, **options)
        if num_io_threads < 1:
            raise ValueError("num_io_threads must be >= 1")
        self.tier_config = tier_config
        self.num_io_threads = num_io_threads
        self._write_pool: ThreadPoolExecutor | None = None
        self._read_pool: ThreadPoolExecutor | None = None

    @property
    def files(self) -> ChunkFiles | None:
        return self.store

    async def on_start(self) -> None:
        n, name = self.num_io_threads, self.actor_id
        self._write_pool = ThreadPoolExecutor(n, thread_name_prefix=f"{name}-write")
        self._read_pool = ThreadPoolExecutor(n, thread_name_prefix=f"{name}-read")
        await super().on_start()

    async def on_stop(self) -> None:
        for pool in (self._write_pool, self._read_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)  # a hung write must not hang stop
        await super().on_stop()

    async def _open(self, layout: KVLayout) -> tuple[ChunkFiles, list[OffloadKey]]:
        files = ChunkFiles(self.tier_config.path, layout)
        scan = await self._in_pool(self._write_pool, files.scan)
        log.info(
            "%r: %s scanned, %d temp files removed", self, files.model_dir, scan.num_temp_removed
        )
        return files, scan.keys

    def _store_chunk(self, store: ChunkFiles, io: ChunkIO) -> asyncio.Future[Exception | None]:
        return self._in_pool(self._write_pool, _write_chunk, store, io)

    def _load_chunk(self, store: ChunkFiles, io: ChunkIO) -> asyncio.Future[Exception | None]:
        return self._in_pool(self._read_pool, _read_chunk, store, io)

    async def _delete_chunks(self, store: ChunkFiles, keys: Sequence[OffloadKey]) -> None:
        await self._in_pool(self._write_pool, _delete_chunks, store, keys)

    def _in_pool(
        self, pool: ThreadPoolExecutor | None, fn: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        assert pool is not None, "the actor is not started"
        return asyncio.get_running_loop().run_in_executor(pool, fn, *args)


def _write_chunk(files: ChunkFiles, io: ChunkIO) -> Exception | None:
    try:
        with io.region.slot(io.slot_id) as slot:
            files.write_chunk(io.key, slot, io.stamp_ns, io.deadline)
    except DeadlinePassed as exc:
        return exc.with_traceback(None)
    except (OSError, ValueError, IndexError) as exc:
        log.warning("fs tier: chunk %s not written: %s", io.key.hex(), exc)
        return exc.with_traceback(None)  # its frames would keep the slot's view alive
    return None


def _read_chunk(files: ChunkFiles, io: ChunkIO) -> Exception | None:
    try:
        with io.region.slot(io.slot_id) as slot:
            files.read_chunk(io.key, slot, io.stamp_ns, io.deadline)
    except DeadlinePassed as exc:
        return exc.with_traceback(None)
    except CorruptChunk as exc:
        log.warning("fs tier: %s (removed)", exc)
        return exc.with_traceback(None)
    except (OSError, ValueError, IndexError) as exc:
        log.warning("fs tier: chunk %s not read: %s", io.key.hex(), exc)
        return exc.with_traceback(None)
    return None


def _delete_chunks(files: ChunkFiles, keys: Sequence[OffloadKey]) -> None:
    for key in keys:
        try:
            files.delete(key)
        except OSError as exc:
            log.warning("fs tier: chunk %s not removed: %s", key.hex(), exc)
