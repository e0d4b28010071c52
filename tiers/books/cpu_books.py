"""The CPU tier's books: its ``OffloadManager`` plus who holds which chunk (``OwnerLeases``).

Pure (no I/O; callers pass ``now``): the actor shell (``tiers.cpu.actor``) moves messages and
waits on secondaries, these methods decide. Every pin taken here is recorded for its owner and
every unpin goes through the record, so the manager's reference counts and the leases agree:
a release naming keys its owner never pinned changes nothing, and an expired lease unpins (or
fails) exactly what it held.

Owners ``PROMOTE_OWNER`` and ``CASCADE_OWNER`` are the tier itself: slots reserved for a
promotion, and chunks pinned while a secondary reads them.

Promotions in flight are known by id (``Promotion``): a lookup whose next key is being promoted
(HIT_PENDING for ``PROMOTE_OWNER``) learns which promotion brings it (``HeadLookup.promotion``)
and may wait for it, then pin what became readable (``lookup_more``), so a chunk two lookups
want is promoted once. A promotion ends finished (its keys readable or dropped) or abandoned
(its answer timed out: the slots stay reserved until their lease ends, and nobody waits on it
any more). Keys pending for an engine core's store have no promotion: a lookup stops there.

Recency: a lookup's HIT run is a reuse (``touch``: the recent end for LRU, T1 → T2 for ARC), and
so is a run pinned after waiting for another lookup's promotion. Stored and promoted chunks
enter as new ones (the manager's insert) with no frequency credit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.books.manager import LookupResult, OffloadManager, PrepareStoreOutput
from shoal.tiers.books.owners import OwnerLeases

PROMOTE_OWNER = "~promote"
CASCADE_OWNER = "~cascade"


@dataclass(frozen=True, slots=True)
class HeadLookup:
    """A lookup's answer from this tier alone: the leading HIT run (pinned), the HIT_PENDING
    run right after it, whether the key after those is a MISS (a secondary may have it), and
    the promotion in flight that brings the first pending key (``None``: no pending key, or an
    engine core's store is writing it)."""

    slot_ids: list[int]
    num_pending: int
    may_promote: bool
    promotion: int | None = None


@dataclass(frozen=True, slots=True)
class Promotion:
    """Slots reserved for a secondary to read ``keys`` into (``slot_ids``, co-indexed)."""

    promotion_id: int
    keys: list[OffloadKey]
    slot_ids: list[int]


@dataclass(slots=True)
class CpuTierCounters:
    num_lookups: int = 0
    num_hit_chunks: int = 0  # chunks answered as held (here or promoted)
    num_promoted: int = 0
    num_promote_failures: int = 0
    promote_time_s: float = 0.0  # waited on secondaries' promotions (their reads)
    num_cascaded: int = 0  # chunks a secondary wrote
    num_cascade_failures: int = 0
    num_cascade_dropped: int = 0  # chunks not cascaded: backpressure or a detached secondary
    num_backpressure_dropped: int = 0  # of those, for a slow tier's moving average
    num_pins_expired: int = 0
    num_stores_expired: int = 0
    num_stale_ignored: int = 0  # releases and renewals naming an earlier region generation
    num_promotion_waits: int = 0  # lookups that waited for another lookup's promotion


class CpuTierBooks:
    def __init__(self, manager: OffloadManager) -> None:
        self.manager = manager
        self.leases = OwnerLeases()
        self.counters = CpuTierCounters()
        self._promotion_ids = itertools.count(1)
        # id → the keys a promotion still holds reserved (until it ends or their lease does)
        self._promotions: dict[int, set[OffloadKey]] = {}
        # key → the promotion in flight bringing it (a lookup may wait for it; not abandoned)
        self._promoting: dict[OffloadKey, int] = {}

    # -- engine cores -----------------------------------------------------------------------

    def lookup_head(
        self, owner: str, keys: Sequence[OffloadKey], now: float, *, use_held: bool = True
    ) -> HeadLookup:
        """Pin and touch the leading HIT run for ``owner``; count the HIT_PENDING run after it.
        Not ``use_held`` (a request that may not load from this tier): nothing is pinned, and a
        prefix that begins with a chunk held (or being stored) here may not be promoted either."""
        self.counters.num_lookups += 1
        return self._pin_run(owner, keys, now, self.manager.lookup, None if use_held else (), True)

    def lookup_more(
        self,
        owner: str,
        keys: Sequence[OffloadKey],
        now: float,
        *,
        only: Collection[OffloadKey] | None = None,
        reused: bool = False,
    ) -> HeadLookup:
        """A lookup goes on with the rest of its prefix, after a promotion (its own, or one it
        waited for: ``reused``, a reuse for the policy): as ``lookup_head``, not counted as a
        query again. ``only``: the keys it may take although held here (the ones it promoted
        itself, for a request that may not load from this tier); it never waits then."""
        return self._pin_run(owner, keys, now, self._peek, only, reused)

    def _pin_run(
        self,
        owner: str,
        keys: Sequence[OffloadKey],
        now: float,
        look: Callable[[OffloadKey], LookupResult],
        only: Collection[OffloadKey] | None,
        touch: bool,
    ) -> HeadLookup:
        """Pin the leading run ``look`` finds ready (of ``only``, if given) and ``touch`` it;
        classify what follows (see ``HeadLookup``)."""
        num_ready = num_pending = 0
        may_promote = False
        for key in keys:
            result = look(key)
            if result is LookupResult.MISS:
                may_promote = num_pending == 0
                break
            if only is not None and key not in only:
                break  # held here, but not to be used by this request
            if result is LookupResult.HIT and not num_pending:
                num_ready += 1
            elif result is LookupResult.HIT_PENDING:
                num_pending += 1
            else:
                break
        run = list(keys[:num_ready])
        slot_ids = self._pin(owner, run, now)
        if touch:
            self.manager.touch(run)
        self.counters.num_hit_chunks += num_ready
        promotion = None
        if num_pending and only is None:
            promotion = self._promoting.get(keys[num_ready])
        return HeadLookup(slot_ids, num_pending, may_promote, promotion)

    def prepare_store(
        self, owner: str, keys: Sequence[OffloadKey], now: float, *, filtered: bool = True
    ) -> PrepareStoreOutput | None:
        """Slots for the new keys of an offer, pending for ``owner``; ``None``: no room."""
        output = self.manager.prepare_store(keys, filtered=filtered)
        if output is not None:
            self.leases.add_stores(owner, output.keys_to_store, now)
        return output

    def release(
        self,
        owner: str,
        loaded_keys: Sequence[OffloadKey],
        stored_keys: Sequence[OffloadKey],
        failed_keys: Sequence[OffloadKey],
    ) -> list[OffloadKey]:
        """Unpin ``owner``'s loads, settle its stores; the keys that became readable."""
        self.manager.complete_load(self.leases.take_pins(owner, loaded_keys))
        stored = self.leases.take_stores(owner, stored_keys)
        self.manager.complete_store(stored, success=True)
        self.manager.complete_store(self.leases.take_stores(owner, failed_keys), success=False)
        return stored

    # -- promotions -------------------------------------------------------------------------

    def reserve_promotion(self, keys: Sequence[OffloadKey], now: float) -> Promotion | None:
        """Slots for a secondary to read ``keys`` into: the keys not held here (those held or
        being written are skipped; ``store_threshold`` is not applied: the chunk was stored
        once). ``None``: nothing to read, or no room."""
        output = self.prepare_store(PROMOTE_OWNER, keys, now, filtered=False)
        if output is None or not output.keys_to_store:
            return None
        promotion = Promotion(next(self._promotion_ids), output.keys_to_store, output.slot_ids)
        self._promotions[promotion.promotion_id] = set(promotion.keys)
        for key in promotion.keys:
            self._promoting[key] = promotion.promotion_id
        return promotion

    def finish_promotion(
        self, promotion: Promotion, done_keys: Collection[OffloadKey]
    ) -> list[OffloadKey]:
        """A promotion answered (or, abandoned, is past the time its secondary may write):
        ``done_keys`` are readable, the rest of its keys are dropped. The keys promoted; a key
        whose reservation expired is not settled (another promotion may hold it now)."""
        held = self._promotions.pop(promotion.promotion_id, set())
        self._stop_waits(promotion.promotion_id, held)
        done = set(done_keys)
        reserved = self.leases.take_stores(
            PROMOTE_OWNER, [key for key in promotion.keys if key in held]
        )
        promoted = [key for key in reserved if key in done]
        self.manager.complete_store(promoted, success=True)
        self.manager.complete_store([k for k in reserved if k not in done], success=False)
        self.counters.num_promoted += len(promoted)
        self.counters.num_promote_failures += len(reserved) - len(promoted)
        return promoted

    def abandon_promotion(self, promotion: Promotion) -> None:
        """A promotion whose answer never came: no lookup waits for it now; the secondary may
        still write its slots until the promotion's deadline, so they stay reserved until the
        caller finishes it (``finish_promotion(promotion, [])``) past that, or their lease
        ends (``expire``)."""
        self._stop_waits(promotion.promotion_id, self._promotions.get(promotion.promotion_id, ()))

    @property
    def num_promotions_in_flight(self) -> int:
        """Promotions a lookup may still wait for."""
        return len(set(self._promoting.values()))

    # -- cascades ---------------------------------------------------------------------------

    def pin_for_cascade(self, keys: Sequence[OffloadKey], now: float) -> list[int]:
        return self._pin(CASCADE_OWNER, keys, now)

    def finish_cascade(self, keys: Sequence[OffloadKey], num_done: int) -> None:
        """A secondary answered a cascade: unpin (an expired pin is not unpinned twice)."""
        self.manager.complete_load(self.leases.take_pins(CASCADE_OWNER, keys))
        self.counters.num_cascaded += num_done
        self.counters.num_cascade_failures += len(keys) - num_done

    # -- leases -----------------------------------------------------------------------------

    def expire(self, cutoff: float) -> list[str]:
        """Unpin and fail everything held since before ``cutoff``; the owners concerned."""
        expired = self.leases.expire(cutoff)
        for key in expired.stores:  # a promotion outlived by its lease brings nothing any more
            self._promoting.pop(key, None)
            for held in self._promotions.values():
                held.discard(key)
        self._promotions = {pid: held for pid, held in self._promotions.items() if held}
        self.manager.complete_load(expired.pins)
        self.manager.complete_store(expired.stores, success=False)
        self.counters.num_pins_expired += len(expired.pins)
        self.counters.num_stores_expired += len(expired.stores)
        return expired.owners

    # -- helpers ----------------------------------------------------------------------------

    def _pin(self, owner: str, keys: Sequence[OffloadKey], now: float) -> list[int]:
        slot_ids = self.manager.prepare_load(keys)
        self.leases.add_pins(owner, keys, now)
        return slot_ids

    def _peek(self, key: OffloadKey) -> LookupResult:
        """What ``manager.lookup`` answers, without counting a query."""
        chunk = self.manager.chunks.get(key)
        if chunk is None:
            return LookupResult.MISS
        return LookupResult.HIT if chunk.is_ready else LookupResult.HIT_PENDING

    def _stop_waits(self, promotion_id: int, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            if self._promoting.get(key) == promotion_id:
                del self._promoting[key]
