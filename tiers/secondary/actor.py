"""What every secondary tier actor (filesystem, object store) shares: the protocol behind a CPU
tier, the LRU index, the cascade queue and the deadlines; a subclass stores and reads the parts.

Requests on ``subjects.tier_in(actor_id)`` (``bus.messages.offload``), each answered:

- ``TierAttach(layout)`` → ``SecondaryAttached(num_chunks, usage)``; the same layout again
  changes nothing, another one (a restarted CPU tier) switches to that layout's chunks, found
  by the subclass's ``_open`` (least recently used first) and indexed within the byte budget
  (``bytes_to_use // layout.slot_bytes`` chunks; the oldest past it are deleted).
- Before its first attach (this actor restarted), every other request gets a ``TierError``:
  the CPU tier's link then attaches it again.
- ``TierLookup`` → ``TierHeld``: the leading keys held and ready (nothing is pinned: a promote
  that follows reads what is still there); a subclass's ``_lookup`` may find more in its store.
- ``TierCascade`` → ``TierJobDone``: stores the slots. Cascades run one at a time in arrival
  order (an eviction's delete and a rewrite of the same key never race); at most
  ``max_queued_cascades`` wait or run, and one past that is answered at once with every key
  failed (stores are dropped under pressure).
- ``TierPromote`` → ``TierJobDone``: reads the leading keys held into the slots (pinned while
  read); done is the prefix read, up to the first key missing or corrupt (``CorruptChunk``:
  dropped from the index, its parts removed by the subclass). Promotes are never dropped and run
  beside the writes.

Both carry a ``deadline`` (``time.time()``; 0.0: none) after which the CPU tier may reuse their
slots: each key's slot is touched only before it, and a cascade publishes a chunk only if the
deadline had not passed once the slot was read (``DeadlinePassed``). Past it, the keys left
fail, and the job answers with them failed. The CPU tier's region is mapped here (the latest
``keep_regions`` generations); the bus carries control only.

With ``kv_events_snapshot_interval_s`` (``plan_tiers``: when the deployment routes by prefix)
the tier publishes its chunks' KV events (``tiers.tier_events``, ``medium`` its type): stored
and evicted chunks, and a snapshot at start, at each attach of a new layout and periodically.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import ClassVar, Generic, Protocol, TypeVar

from shoal.bus.base import Bus
from shoal.bus.codec import Codec
from shoal.bus.messages.offload import (
    KVLayout,
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
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import Actor, Inbox
from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.books.manager import LookupResult, OffloadManager
from shoal.tiers.cpu.mapped_regions import MappedRegions
from shoal.tiers.cpu.region import SharedRegion
from shoal.tiers.secondary.chunk_format import CorruptChunk, DeadlinePassed
from shoal.tiers.tier_events import TierEvents, watch_manager

log = logging.getLogger(__name__)

_INBOUND: Codec[SecondaryInbound] = Codec(SecondaryInbound)


class ChunkStore(Protocol):
    """A layout's chunks in some store (``ChunkFiles``, ``ObjectChunks``)."""

    @property
    def layout(self) -> KVLayout: ...


S = TypeVar("S", bound=ChunkStore)


@dataclass(frozen=True, slots=True)
class ChunkIO:
    """One key of a job: its slot in the mapped region, a recency stamp (``time_ns``: a
    request's tail a little older than its head, as the LRU index has them) and the deadline."""

    region: SharedRegion
    key: OffloadKey
    slot_id: int
    stamp_ns: int
    deadline: float


ChunkJob = Callable[[S, ChunkIO], Awaitable[Exception | None]]


@dataclass(slots=True)
class SecondaryTierCounters:
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
    """An LRU index of the chunks found (least recently used first) and the keys that did not
    fit in ``num_slots`` (the oldest), which the caller removes."""
    index = OffloadManager(num_slots, "lru")
    evicted: list[OffloadKey] = []
    for key in keys:
        out = index.prepare_store([key])
        assert out is not None  # every chunk held is idle: one can always leave
        evicted.extend(out.evicted_keys)
        index.complete_store([key])
    index.take_events()
    return index, evicted


class SecondaryTierActor(Actor, Generic[S]):
    """The shared shell; a subclass opens a layout's chunks and stores, reads and deletes them."""

    kind = "tier"
    medium: ClassVar[str]  # its type, in its KV events: "fs", "obj"

    def __init__(
        self,
        bus: Bus,
        actor_id: str,
        *,
        bytes_to_use: int,
        namespace: str = "shoal",
        max_queued_cascades: int = 64,
        keep_regions: int = 2,
        kv_events_snapshot_interval_s: float | None = None,  # None: no KV events published
        jetstream_replicas: int = 1,  # copies of a bucket or stream it creates
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
        if max_queued_cascades < 1 or keep_regions < 1:
            raise ValueError("max_queued_cascades and keep_regions must be >= 1")
        self.bytes_to_use = bytes_to_use
        self.max_queued_cascades = max_queued_cascades
        self.counters = SecondaryTierCounters()
        self.store: S | None = None  # the attached layout's chunks, indexed by ``index``
        self.index: OffloadManager | None = None
        self.regions = MappedRegions(keep_regions)
        self.num_cascades_queued = 0  # waiting or running
        self._attach_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()
        self.jetstream_replicas = jetstream_replicas
        self.kv_events = TierEvents.make(
            bus,
            self.subjects,
            actor_id,
            self.medium,
            self._holdings,
            kv_events_snapshot_interval_s,
            jetstream_replicas,
        )
        self._events_task: asyncio.Task[None] | None = None

    # -- what a subclass provides ---------------------------------------------------------------

    @abstractmethod
    async def _open(self, layout: KVLayout) -> tuple[S, list[OffloadKey]]:
        """``layout``'s chunks and the complete ones found there, least recently used first.
        An ``OSError`` (or a ``TierUnavailable``) refuses the attach."""

    @abstractmethod
    def _store_chunk(self, store: S, io: ChunkIO) -> Awaitable[Exception | None]:
        """Store ``io``'s slot under its key; the error (``DeadlinePassed``, ...) or None."""

    @abstractmethod
    def _load_chunk(self, store: S, io: ChunkIO) -> Awaitable[Exception | None]:
        """Read ``io``'s key into its slot; ``CorruptChunk`` once its parts are removed."""

    @abstractmethod
    async def _delete_chunks(self, store: S, keys: Sequence[OffloadKey]) -> None:
        """Remove the chunks (errors logged, not raised)."""

    # -- the shell ------------------------------------------------------------------------------

    def inboxes(self) -> Sequence[Inbox]:
        return [Inbox(self.subjects.tier_in(self.actor_id), self.on_request, _INBOUND)]

    async def on_start(self) -> None:
        if self.kv_events is not None:
            self._events_task = asyncio.create_task(self.kv_events.run(self.incarnation))

    async def on_stop(self) -> None:
        task, self._events_task = self._events_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.regions.close()

    def _holdings(self) -> tuple[OffloadManager, int] | None:
        store, index = self.store, self.index
        if store is None or index is None:
            return None
        return index, store.layout.block_size * store.layout.blocks_per_chunk

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
        if self.store is None and not self._attach_lock.locked():
            # never attached (this actor restarted): the CPU tier's link attaches it again
            return TierError(f"tier {self.actor_id} is not attached: send TierAttach first")
        match request:
            case TierLookup(keys=keys):
                return TierHeld(await self._lookup(keys))
            case TierCascade():
                return await self._cascade(request)
            case TierPromote():
                return await self._promote(request)

    # -- attach and lookup ----------------------------------------------------------------------

    async def _attach(self, layout: KVLayout) -> TierReply:
        async with self._attach_lock:
            if self.store is None or self.store.layout != layout:
                num_slots = self.bytes_to_use // layout.slot_bytes
                if num_slots < 1:
                    return TierError(
                        f"bytes_to_use {self.bytes_to_use} holds no chunk of "
                        f"{layout.slot_bytes} bytes"
                    )
                self.store = self.index = None  # nothing is served while the layout changes
                try:
                    store, found = await self._open(layout)
                except (OSError, TierUnavailable) as exc:
                    return TierError(f"cannot open the chunks of {layout.model_tag}: {exc}")
                index, evicted = index_from_scan(num_slots, found)
                await self._evict(store, evicted)
                self.store, self.index = store, index
                watch_manager(self.kv_events, index)
                log.info("%r: %d chunks found (%d over budget)", self, len(found), len(evicted))
            assert self.index is not None
            return SecondaryAttached(len(self.index.chunks), self.index.usage)

    async def _lookup(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading ``keys`` are held: the index's answer (a subclass whose store other
        hosts write to may look there for the keys past it)."""
        return self._num_leading_ready(keys)

    def _num_leading_ready(self, keys: Iterable[OffloadKey]) -> int:
        index, num = self.index, 0
        if index is None:
            return 0
        for key in keys:
            if index.lookup(key) is not LookupResult.HIT:
                break
            num += 1
        return num

    async def _evict(self, store: S, keys: Sequence[OffloadKey]) -> None:
        if keys:
            await self._delete_chunks(store, keys)
            self.counters.num_chunks_evicted += len(keys)

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
        store, index = self.store, self.index
        keys = list(dict.fromkeys(job.keys))
        if store is None or index is None or store.layout != job.region.layout:
            self.counters.num_store_failures += len(keys)
            return TierJobDone(failed_keys=keys)
        if is_past(job.deadline):  # it waited too long for the write lock
            self.counters.num_store_failures += len(keys)
            self.counters.num_chunks_late += len(keys)
            return TierJobDone(failed_keys=keys)
        out = index.prepare_store(keys)
        if out is None:  # no room: every chunk held is being read
            failed = [k for k in keys if k not in index.chunks]
            self.counters.num_store_failures += len(failed)
            return TierJobDone([k for k in keys if k not in failed], failed)
        await self._evict(store, out.evicted_keys)
        errors = await self._with_region(store, job, out.keys_to_store, self._store_chunk)
        failed = [k for k, e in zip(out.keys_to_store, errors, strict=True) if e is not None]
        self.counters.num_chunks_late += sum(isinstance(e, DeadlinePassed) for e in errors)
        index.complete_store([k for k in out.keys_to_store if k not in failed], success=True)
        index.complete_store(failed, success=False)
        self.counters.num_chunks_stored += len(out.keys_to_store) - len(failed)
        self.counters.num_store_failures += len(failed)
        return TierJobDone([k for k in keys if k not in failed], failed)

    # -- promotes (loads) -----------------------------------------------------------------------

    async def _promote(self, job: TierPromote) -> TierReply:
        if len(job.keys) != len(job.slot_ids):
            return TierError("a promote needs one slot id per key")
        store, index = self.store, self.index
        if store is None or index is None or store.layout != job.region.layout:
            return TierJobDone(failed_keys=list(job.keys))
        if is_past(job.deadline):
            self.counters.num_chunks_late += len(job.keys)
            return TierJobDone(failed_keys=list(job.keys))
        wanted = list(job.keys[: self._num_leading_ready(job.keys)])
        index.prepare_load(wanted)  # pinned: no cascade evicts them while they are read
        try:
            errors = await self._with_region(store, job, wanted, self._load_chunk)
        finally:
            index.complete_load(wanted)
        corrupt = [k for k, e in zip(wanted, errors, strict=True) if isinstance(e, CorruptChunk)]
        index.discard(corrupt)
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

    async def _with_region(
        self,
        store: S,
        job: TierCascade | TierPromote,
        keys: Sequence[OffloadKey],
        chunk_job: ChunkJob[S],
    ) -> list[Exception | None]:
        """``chunk_job`` for every key at once on the job's mapped region (each key with its
        slot, a recency stamp and the deadline); each one's error (None: done). A region that
        cannot be mapped fails them all."""
        if not keys:
            return []
        slot_of = dict(zip(job.keys, job.slot_ids, strict=True))
        stamp_of = recency_stamps(keys)
        try:
            with self.regions.use(job.region) as region:
                return list(
                    await asyncio.gather(
                        *(
                            chunk_job(
                                store, ChunkIO(region, k, slot_of[k], stamp_of[k], job.deadline)
                            )
                            for k in keys
                        )
                    )
                )
        except OSError as exc:
            log.warning("%r: region %s not mapped: %s", self, job.region.path, exc)
            return [exc] * len(keys)


class TierUnavailable(Exception):
    """The tier's store cannot be reached now (an attach is refused; the CPU tier retries)."""


def is_past(deadline: float) -> bool:
    return bool(deadline) and time.time() > deadline


def recency_stamps(keys: Sequence[OffloadKey]) -> dict[OffloadKey, int]:
    """Stamps for a request's keys (prefix order) that order them as the LRU index does: now
    for the head, a microsecond older per key towards the tail."""
    now = time.time_ns()
    return {key: now - 1000 * i for i, key in enumerate(keys)}
