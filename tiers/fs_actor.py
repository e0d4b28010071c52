"""The filesystem tier actor: a secondary tier behind a CPU tier on the same host.

It keeps chunks as files (``tiers.fs_store.ChunkFiles``) under ``FsTierConfig.path`` and moves
their bytes to and from the CPU tier's shared-memory region, which it maps itself (the latest
``keep_regions`` generations); the bus carries control only (``bus.messages.offload``). Its
index is an ``OffloadManager`` (LRU) of ``bytes_to_use // layout.slot_bytes`` chunks, rebuilt
from the files at attach, least recently used first; chunks past the budget are evicted and
their files removed. Requests on ``subjects.tier_in(actor_id)``, each answered:

- ``TierAttach(layout)`` → ``SecondaryAttached(num_chunks, usage)``; the same layout again
  changes nothing, another one (a restarted CPU tier) switches to that layout's files.
- ``TierLookup`` → ``TierHeld``: the leading keys held and ready (nothing is pinned: a promote
  that follows reads what is still there).
- ``TierCascade`` → ``TierJobDone``: writes the slots as files. Cascades run one at a time in
  arrival order (an eviction's delete and a rewrite of the same key never race); at most
  ``max_queued_cascades`` wait or run, and one past that is answered at once with every key
  failed (stores are dropped under pressure).
- ``TierPromote`` → ``TierJobDone``: reads the leading keys held into the slots (pinned while
  read); done is the prefix read, up to the first key missing or corrupt (dropped from the
  index, its files removed). Promotes are never dropped and run beside the writes.

Both carry a ``deadline`` (``time.time()``; 0.0: none) after which the CPU tier may reuse their
slots: each key's slot is touched only before it, and a cascade publishes a file only if the
deadline had not passed once the slot was read (``fs_store.DeadlinePassed``). Past it, the keys
left fail, each at once (a key's I/O already under way is waited for: it holds the mapping),
and the job answers with them failed.

File I/O runs in two small thread pools (writes, reads), so heartbeats, lookups and promotes go on
while a write is slow.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from shoal.bus.actor import Actor, Inbox
from shoal.bus.base import Bus, Msg
from shoal.bus.codec import Codec
from shoal.bus.messages.config import FsTierConfig
from shoal.bus.messages.offload import (
    KVLayout,
    RegionRef,
    SecondaryAttached,
    SecondaryInbound,
    TierAttach,
    TierCascade,
    TierError,
    TierHeld,
    TierJobDone,
    TierLookup,
    TierPromote,
    TierReply,
)
from shoal.tiers.fs_store import ChunkFiles, CorruptChunk, DeadlinePassed
from shoal.tiers.keys import OffloadKey
from shoal.tiers.manager import LookupResult, OffloadManager
from shoal.tiers.mapped_regions import MappedRegions
from shoal.tiers.region import SharedRegion

log = logging.getLogger(__name__)

T = TypeVar("T")
_INBOUND: Codec[SecondaryInbound] = Codec(SecondaryInbound)


@dataclass(slots=True)
class FsTierCounters:
    """What the tier did, in chunks; sent with every heartbeat (``load``)."""

    num_chunks_stored: int = 0  # written by cascades
    num_chunks_loaded: int = 0  # read by promotes
    num_chunks_evicted: int = 0  # removed for the byte budget
    num_chunks_corrupt: int = 0  # found missing or damaged by a read (removed)
    num_chunks_dropped: int = 0  # of cascades refused under backpressure
    num_store_failures: int = 0  # chunks not written (no room, a write error, no region)
    num_load_failures: int = 0  # chunks not read for another reason (a read error, no region)
    num_chunks_late: int = 0  # of cascades and promotes failed past their deadline


def index_from_scan(
    num_slots: int, keys: Sequence[OffloadKey]
) -> tuple[OffloadManager, list[OffloadKey]]:
    """An LRU index of the chunks found on disk (least recently used first) and the keys that
    did not fit in ``num_slots`` (the oldest), whose files the caller removes."""
    index = OffloadManager(num_slots, "lru")
    evicted: list[OffloadKey] = []
    for key in keys:
        out = index.prepare_store([key])
        assert out is not None  # every chunk held is idle: one can always leave
        evicted.extend(out.evicted_keys)
        index.complete_store([key])
    index.take_events()
    return index, evicted


class FsTierActor(Actor):
    """A filesystem tier (``FsTierConfig``) reached on ``subjects.tier_in(actor_id)``."""

    kind = "tier"

    def __init__(
        self,
        bus: Bus,
        actor_id: str,
        *,
        tier_config: FsTierConfig,
        namespace: str = "shoal",
        max_queued_cascades: int = 64,
        num_io_threads: int = 4,
        keep_regions: int = 2,
        heartbeat_interval_s: float = 1.0,
        drain_timeout_s: float = 5.0,
    ) -> None:
        super().__init__(
            bus,
            actor_id,
            namespace=namespace,
            heartbeat_interval_s=heartbeat_interval_s,
            drain_timeout_s=drain_timeout_s,
        )
        if max_queued_cascades < 1 or num_io_threads < 1 or keep_regions < 1:
            raise ValueError("max_queued_cascades, num_io_threads and keep_regions must be >= 1")
        self.tier_config = tier_config
        self.max_queued_cascades = max_queued_cascades
        self.num_io_threads = num_io_threads
        self.counters = FsTierCounters()
        self.files: ChunkFiles | None = None
        self.index: OffloadManager | None = None
        self.regions = MappedRegions(keep_regions)
        self.num_cascades_queued = 0  # waiting or running
        self._attach_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()
        self._write_pool: ThreadPoolExecutor | None = None
        self._read_pool: ThreadPoolExecutor | None = None

    def inboxes(self) -> Sequence[Inbox]:
        return [Inbox(self.subjects.tier_in(self.actor_id), self.on_request, _INBOUND)]

    async def on_start(self) -> None:
        n, name = self.num_io_threads, self.actor_id
        self._write_pool = ThreadPoolExecutor(n, thread_name_prefix=f"{name}-write")
        self._read_pool = ThreadPoolExecutor(n, thread_name_prefix=f"{name}-read")

    async def on_stop(self) -> None:
        for pool in (self._write_pool, self._read_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)  # a hung write must not hang stop
        self.regions.close()

    def load(self) -> dict[str, float]:
        index = self.index
        figures = {name: float(value) for name, value in asdict(self.counters).items()}
        figures["num_chunks_held"] = float(len(index.chunks)) if index is not None else 0.0
        figures["usage"] = index.usage if index is not None else 0.0
        figures["num_cascades_queued"] = float(self.num_cascades_queued)
        return figures

    async def on_request(self, request: SecondaryInbound, msg: Msg) -> TierReply:
        match request:
            case TierAttach(layout=layout):
                return await self._attach(layout)
            case TierLookup(keys=keys):
                return TierHeld(self._num_leading_ready(keys))
            case TierCascade():
                return await self._cascade(request)
            case TierPromote():
                return await self._promote(request)

    # -- attach and lookup ----------------------------------------------------------------------

    async def _attach(self, layout: KVLayout) -> TierReply:
        async with self._attach_lock:
            if self.files is None or self.files.layout != layout:
                num_slots = self.tier_config.bytes_to_use // layout.slot_bytes
                if num_slots < 1:
                    return TierError(
                        f"bytes_to_use {self.tier_config.bytes_to_use} holds no chunk of "
                        f"{layout.slot_bytes} bytes"
                    )
                files = ChunkFiles(self.tier_config.path, layout)
                try:
                    scan = await self._in_pool(self._write_pool, files.scan)
                except OSError as exc:
                    return TierError(f"cannot scan {files.model_dir}: {exc}")
                index, evicted = index_from_scan(num_slots, scan.keys)
                await self._delete(files, evicted)
                self.files, self.index = files, index
                log.info(
                    "%r: %d chunks found in %s (%d over budget, %d temp files removed)",
                    self,
                    len(index.chunks),
                    files.model_dir,
                    len(evicted),
                    scan.num_temp_removed,
                )
            assert self.index is not None
            return SecondaryAttached(len(self.index.chunks), self.index.usage)

    def _num_leading_ready(self, keys: Iterable[OffloadKey]) -> int:
        index, num = self.index, 0
        if index is None:
            return 0
        for key in keys:
            if index.lookup(key) is not LookupResult.HIT:
                break
            num += 1
        return num

    # -- cascades (stores) ----------------------------------------------------------------------

    async def _cascade(self, job: TierCascade) -> TierReply:
        if len(job.keys) != len(job.slot_ids):
            return TierError("a cascade needs one slot id per key")
        if self.num_cascades_queued >= self.max_queued_cascades:
            self.counters.num_chunks_dropped += len(job.keys)
            return TierJobDone(failed_keys=list(job.keys))
        self.num_cascades_queued += 1
        try:
            async with self._write_lock:
                return await self._write(job)
        finally:
            self.num_cascades_queued -= 1

    async def _write(self, job: TierCascade) -> TierJobDone:
        files, index = self.files, self.index
        keys = list(dict.fromkeys(job.keys))
        if files is None or index is None or files.layout != job.region.layout:
            self.counters.num_store_failures += len(keys)
            return TierJobDone(failed_keys=keys)
        if _is_past(job.deadline):  # it waited too long for the write lock
            self.counters.num_store_failures += len(keys)
            self.counters.num_chunks_late += len(keys)
            return TierJobDone(failed_keys=keys)
        out = index.prepare_store(keys)
        if out is None:  # no room: every chunk held is being read
            failed = [k for k in keys if k not in index.chunks]
            self.counters.num_store_failures += len(failed)
            return TierJobDone([k for k in keys if k not in failed], failed)
        await self._delete(files, out.evicted_keys)
        slot_of = dict(zip(job.keys, job.slot_ids, strict=True))
        stamp_of = _recency_stamps(out.keys_to_store)
        written = await self._with_region(
            job.region,
            out.keys_to_store,
            lambda region, key: self._in_pool(
                self._write_pool,
                _write_chunk,
                files,
                region,
                key,
                slot_of[key],
                stamp_of[key],
                job.deadline,
            ),
        )
        failed = [k for k, ok in zip(out.keys_to_store, written, strict=True) if ok is not None]
        self.counters.num_chunks_late += sum(isinstance(e, DeadlinePassed) for e in written)
        index.complete_store([k for k in out.keys_to_store if k not in failed], success=True)
        index.complete_store(failed, success=False)
        index.take_events()
        self.counters.num_chunks_stored += len(out.keys_to_store) - len(failed)
        self.counters.num_store_failures += len(failed)
        return TierJobDone([k for k in keys if k not in failed], failed)

    async def _delete(self, files: ChunkFiles, keys: Sequence[OffloadKey]) -> None:
        if keys:
            await self._in_pool(self._write_pool, _delete_chunks, files, keys)
            self.counters.num_chunks_evicted += len(keys)

    # -- promotes (loads) -----------------------------------------------------------------------

    async def _promote(self, job: TierPromote) -> TierReply:
        if len(job.keys) != len(job.slot_ids):
            return TierError("a promote needs one slot id per key")
        files, index = self.files, self.index
        if files is None or index is None or files.layout != job.region.layout:
            return TierJobDone(failed_keys=list(job.keys))
        if _is_past(job.deadline):
            self.counters.num_chunks_late += len(job.keys)
            return TierJobDone(failed_keys=list(job.keys))
        wanted = list(job.keys[: self._num_leading_ready(job.keys)])
        slot_of = dict(zip(job.keys, job.slot_ids, strict=True))
        stamp_of = _recency_stamps(wanted)
        index.prepare_load(wanted)  # pinned: no cascade evicts them while they are read
        try:
            errors = await self._with_region(
                job.region,
                wanted,
                lambda region, key: self._in_pool(
                    self._read_pool,
                    _read_chunk,
                    files,
                    region,
                    key,
                    slot_of[key],
                    stamp_of[key],
                    job.deadline,
                ),
            )
        finally:
            index.complete_load(wanted)
        corrupt = [k for k, e in zip(wanted, errors, strict=True) if isinstance(e, CorruptChunk)]
        index.discard(corrupt)
        index.take_events()
        num_done = next((i for i, e in enumerate(errors) if e is not None), len(wanted))
        done = list(job.keys[:num_done])
        index.touch(done)
        self.counters.num_chunks_loaded += num_done
        self.counters.num_chunks_corrupt += len(corrupt)
        self.counters.num_load_failures += sum(
            1 for e in errors if e is not None and not isinstance(e, CorruptChunk)
        )
        self.counters.num_chunks_late += sum(isinstance(e, DeadlinePassed) for e in errors)
        return TierJobDone(done, list(job.keys[num_done:]))

    # -- helpers --------------------------------------------------------------------------------

    async def _with_region(
        self,
        ref: RegionRef,
        keys: Sequence[OffloadKey],
        job: Callable[[SharedRegion, OffloadKey], asyncio.Future[Exception | None]],
    ) -> list[Exception | None]:
        """``job(region, key)`` for every key at once on the mapped region; each one's error
        (None: done). A region that cannot be mapped fails them all."""
        if not keys:
            return []
        try:
            with self.regions.use(ref) as region:
                return list(await asyncio.gather(*(job(region, key) for key in keys)))
        except OSError as exc:
            log.warning("%r: region %s not mapped: %s", self, ref.path, exc)
            return [exc] * len(keys)

    def _in_pool(
        self, pool: ThreadPoolExecutor | None, fn: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        assert pool is not None, "the actor is not started"
        return asyncio.get_running_loop().run_in_executor(pool, fn, *args)


def _is_past(deadline: float) -> bool:
    return bool(deadline) and time.time() > deadline


def _recency_stamps(keys: Sequence[OffloadKey]) -> dict[OffloadKey, int]:
    """File mtimes for a request's keys (prefix order) that order them as the LRU index does:
    now for the head, a microsecond older per key towards the tail (``ChunkFiles.scan``)."""
    now = time.time_ns()
    return {key: now - 1000 * i for i, key in enumerate(keys)}


def _write_chunk(
    files: ChunkFiles,
    region: SharedRegion,
    key: OffloadKey,
    slot_id: int,
    stamp_ns: int,
    deadline: float,
) -> Exception | None:
    try:
        with region.slot(slot_id) as slot:
            files.write_chunk(key, slot, stamp_ns, deadline)
    except DeadlinePassed as exc:
        return exc.with_traceback(None)
    except (OSError, ValueError, IndexError) as exc:
        log.warning("fs tier: chunk %s not written: %s", key.hex(), exc)
        return exc.with_traceback(None)  # its frames would keep the slot's view alive
    return None


def _read_chunk(
    files: ChunkFiles,
    region: SharedRegion,
    key: OffloadKey,
    slot_id: int,
    stamp_ns: int,
    deadline: float,
) -> Exception | None:
    try:
        with region.slot(slot_id) as slot:
            files.read_chunk(key, slot, stamp_ns, deadline)
    except DeadlinePassed as exc:
        return exc.with_traceback(None)
    except CorruptChunk as exc:
        log.warning("fs tier: %s (removed)", exc)
        return exc.with_traceback(None)
    except (OSError, ValueError, IndexError) as exc:
        log.warning("fs tier: chunk %s not read: %s", key.hex(), exc)
        return exc.with_traceback(None)
    return None


def _delete_chunks(files: ChunkFiles, keys: Sequence[OffloadKey]) -> None:
    for key in keys:
        try:
            files.delete(key)
        except OSError as exc:
            log.warning("fs tier: chunk %s not removed: %s", key.hex(), exc)
