"""The offload manager of one tier: which chunks it holds, in which slots, and which may leave.

Pure bookkeeping (no I/O, no clock, no torch): the tier actor or the engine's connector calls it,
moves the bytes, and reports back. A tier has ``num_slots`` chunk slots. The protocol:

* ``lookup(key)`` → ``MISS``, ``HIT`` (ready), ``HIT_PENDING`` (its write is still in flight);
  ``RETRY`` is for tiers that answer later (never returned here).
* ``prepare_load(keys)``: every key must be a ``HIT``; pins them (``ref_cnt += 1``) and returns
  their slot ids, co-indexed with the keys. ``complete_load(keys)`` unpins.
* ``prepare_store(keys)``: skips keys already held (and, with ``store_threshold``, keys not
  offered often enough yet); allocates a slot per new key, fresh ids ``0, 1, 2, ...`` first, then
  the free list (last freed, first reused); evicts idle chunks to make room, never a key of the
  same offer. Atomic: all new keys get a slot, or it returns ``None`` and no chunk changes. New
  chunks are not ready (``ref_cnt == NOT_READY``) until ``complete_store``.
* ``complete_store(keys, success)``: ready on success; on failure, the keys that never became
  ready are removed and their slots freed (ready ones are left alone).
* ``discard(keys)``: forget idle ready chunks whose bytes a tier lost (a corrupt file).
* ``touch(keys)`` / ``on_request_finished(keys, inserted_keys)``: a request's access, in prefix
  order, for the eviction policy (recency, and frequency for ARC). Transfers never change recency.
* ``take_events()``: stored and evicted events since the last call, stores first (logged only
  while ``records_events``: a tier that publishes none turns it off).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.books.policies import NOT_READY, Chunk, EvictionPolicy, make_policy
from shoal.tiers.books.store_filter import DEFAULT_MAX_TRACKER_SIZE, StoreFilter


class LookupResult(enum.Enum):
    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"  # found, but its write has not completed
    RETRY = "retry"  # not known yet; ask again later (asynchronous tiers)


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """What to write where: ``slot_ids`` co-indexed with ``keys_to_store``, and the evictions."""

    keys_to_store: list[OffloadKey]
    slot_ids: list[int]
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True, slots=True)
class OffloadEvent:
    """Keys that became readable in this tier (``removed=False``) or left it (``removed=True``)."""

    keys: tuple[OffloadKey, ...]
    removed: bool


@dataclass(slots=True)
class OffloadStats:
    """Counters for metrics; they only grow (usage is read from the manager)."""

    num_queries: int = 0
    num_hits: int = 0  # HIT or HIT_PENDING
    num_stores_skipped: int = 0  # offers held back by store_threshold
    num_stored: int = 0  # chunks that became ready
    num_evicted: int = 0
    num_store_failures: int = 0  # chunks removed by a failed complete_store
    num_store_rejections: int = 0  # prepare_store calls answered None (no room)


@dataclass(slots=True)
class _Slots:
    """Fresh slot ids first, then the free list, last freed first."""

    capacity: int
    next_fresh: int = 0
    free: list[int] = field(default_factory=list)

    @property
    def num_free(self) -> int:
        return self.capacity - self.next_fresh + len(self.free)

    def allocate(self) -> int:
        if self.next_fresh < self.capacity:
            self.next_fresh += 1
            return self.next_fresh - 1
        return self.free.pop()

    def release(self, slot_id: int) -> None:
        self.free.append(slot_id)


class OffloadManager:
    def __init__(
        self,
        num_slots: int,
        eviction_policy: str = "lru",
        store_threshold: int = 0,
        max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"an offload tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.chunks: dict[OffloadKey, Chunk] = {}
        self.policy: EvictionPolicy = make_policy(eviction_policy, num_slots, self.chunks)
        self.store_filter = StoreFilter(store_threshold, max_tracker_size)
        self.stats = OffloadStats()
        self._slots = _Slots(num_slots)
        self._stored_events: list[OffloadEvent] = []
        self._evicted_events: list[OffloadEvent] = []
        self.records_events = True

    # -- lookups and loads ------------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> LookupResult:
        self.stats.num_queries += 1
        chunk = self.chunks.get(key)
        if chunk is None:
            return LookupResult.MISS
        self.stats.num_hits += 1
        return LookupResult.HIT if chunk.is_ready else LookupResult.HIT_PENDING

    def prepare_load(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Pin ``keys`` (all ready) until ``complete_load``; their slot ids, in the same order."""
        chunks = [self.chunks.get(key) for key in keys]
        for key, chunk in zip(keys, chunks, strict=True):
            if chunk is None or not chunk.is_ready:
                raise ValueError(f"prepare_load of {key.hex()}: not a HIT in this tier")
        slot_ids = []
        for chunk in chunks:
            assert chunk is not None
            chunk.ref_cnt += 1
            slot_ids.append(chunk.slot_id)
        return slot_ids

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        """Unpin chunks of an earlier ``prepare_load``; an idle chunk may be evicted again."""
        keys = list(keys)
        for key in keys:
            chunk = self.chunks.get(key)
            if chunk is None or chunk.ref_cnt <= 0:
                raise ValueError(f"complete_load of {key.hex()}: it is not being loaded")
        for key in keys:
            self.chunks[key].ref_cnt -= 1

    # -- stores -----------------------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[OffloadKey], *, filtered: bool = True
    ) -> PrepareStoreOutput | None:
        """Slots for the new keys of an offer (evicting idle chunks), or ``None`` if no room.
        ``filtered=False`` skips ``store_threshold`` (a promotion from a lower tier: the chunk
        was worth storing already)."""
        offered = list(dict.fromkeys(keys))  # drop repeats, keep prefix order
        new_keys = []
        for key in offered:
            if key in self.chunks:
                continue
            if not filtered or self.store_filter.offer(key):
                new_keys.append(key)
            else:
                self.stats.num_stores_skipped += 1
        num_to_evict = len(new_keys) - self._slots.num_free
        evicted = self.policy.evict(num_to_evict, set(offered)) if num_to_evict > 0 else []
        if evicted is None:
            self.stats.num_store_rejections += 1
            return None
        for key in evicted:
            self._slots.release(self.chunks.pop(key).slot_id)
        if evicted:
            self.stats.num_evicted += len(evicted)
            self._log_event(evicted, removed=True)
        slot_ids = []
        for key in new_keys:
            slot_id = self._slots.allocate()
            self.chunks[key] = Chunk(slot_id, NOT_READY)
            self.store_filter.forget(key)
            slot_ids.append(slot_id)
        self.policy.insert(new_keys)
        return PrepareStoreOutput(new_keys, slot_ids, evicted)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        """The writes of an earlier ``prepare_store`` ended; unknown or ready keys are ignored."""
        changed = []
        for key in dict.fromkeys(keys):
            chunk = self.chunks.get(key)
            if chunk is None or chunk.is_ready:
                continue
            if success:
                chunk.ref_cnt = 0
            else:
                del self.chunks[key]
                self.policy.remove(key)
                self._slots.release(chunk.slot_id)
            changed.append(key)
        if success and changed:
            self.stats.num_stored += len(changed)
            self._log_event(changed, removed=False)
        elif changed:
            self.stats.num_store_failures += len(changed)

    def discard(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Forget idle ready chunks whose bytes were lost (a tier found them corrupt); pinned,
        unready or unknown keys are left alone. The keys forgotten, also as a removed event."""
        gone = [k for k in dict.fromkeys(keys) if k in self.chunks and self.chunks[k].ref_cnt == 0]
        for key in gone:
            self.policy.remove(key)
            self._slots.release(self.chunks.pop(key).slot_id)
        if gone:
            self._log_event(gone, removed=True)
        return gone

    # -- recency, events, usage -------------------------------------------------------------

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """A request reused ``keys`` (prefix order, head first): more recent, tail before head."""
        self.policy.touch(list(keys))

    def on_request_finished(
        self, keys: Sequence[OffloadKey], inserted_keys: Collection[OffloadKey] = ()
    ) -> None:
        """Commit a finished request's access (prefix order); ``inserted_keys`` it only stored."""
        self.policy.on_request_finished(list(keys), set(inserted_keys))

    def _log_event(self, keys: Sequence[OffloadKey], *, removed: bool) -> None:
        if self.records_events:
            events = self._evicted_events if removed else self._stored_events
            events.append(OffloadEvent(tuple(keys), removed=removed))

    def take_events(self) -> list[OffloadEvent]:
        """Events since the last call: every stored event, then every evicted one."""
        events = self._stored_events + self._evicted_events
        self._stored_events = []
        self._evicted_events = []
        return events

    @property
    def num_used_slots(self) -> int:
        return len(self.chunks)

    @property
    def usage(self) -> float:
        """Fraction of slots held (ready or being written), 0.0 to 1.0."""
        return len(self.chunks) / self.num_slots
