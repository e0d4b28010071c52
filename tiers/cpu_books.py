"""The CPU tier's books: its ``OffloadManager`` plus who holds which chunk (``OwnerLeases``).

Pure (no I/O; callers pass ``now``): the actor shell (``tiers.cpu_actor``) moves messages and
waits on secondaries, these methods decide. Every pin taken here is recorded for its owner and
every unpin goes through the record, so the manager's reference counts and the leases agree:
a release naming keys its owner never pinned changes nothing, and an expired lease unpins (or
fails) exactly what it held.

Owners ``PROMOTE_OWNER`` and ``CASCADE_OWNER`` are the tier itself: slots reserved for a
promotion, and chunks pinned while a secondary reads them.

Recency: a lookup's HIT run is a reuse (``touch``: the recent end for LRU, T1 → T2 for ARC).
Stored and promoted chunks enter as new ones (the manager's insert) with no frequency credit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.tiers.keys import OffloadKey
from shoal.tiers.manager import LookupResult, OffloadManager, PrepareStoreOutput
from shoal.tiers.owners import OwnerLeases

PROMOTE_OWNER = "~promote"
CASCADE_OWNER = "~cascade"


@dataclass(frozen=True, slots=True)
class HeadLookup:
    """A lookup's answer from this tier alone: the leading HIT run (pinned), the HIT_PENDING
    run right after it, and whether the key after those is a MISS (a secondary may have it)."""

    slot_ids: list[int]
    num_pending: int
    may_promote: bool


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


class CpuTierBooks:
    def __init__(self, manager: OffloadManager) -> None:
        self.manager = manager
        self.leases = OwnerLeases()
        self.counters = CpuTierCounters()

    # -- engine cores -----------------------------------------------------------------------

    def lookup_head(
        self, owner: str, keys: Sequence[OffloadKey], now: float, *, use_held: bool = True
    ) -> HeadLookup:
        """Pin and touch the leading HIT run for ``owner``; count the HIT_PENDING run after it.
        Not ``use_held`` (a request that may not load from this tier): nothing is pinned, and a
        prefix that begins with a chunk held (or being stored) here may not be promoted either."""
        self.counters.num_lookups += 1
        if not use_held:
            first = self.manager.lookup(keys[0]) if keys else LookupResult.MISS
            held = first in (LookupResult.HIT, LookupResult.HIT_PENDING)
            return HeadLookup([], 0, bool(keys) and not held)
        num_hits = num_pending = 0
        for key in keys:
            result = self.manager.lookup(key)
            if result is LookupResult.HIT and not num_pending:
                num_hits += 1
            elif result is LookupResult.HIT_PENDING:
                num_pending += 1
            else:
                break
        head = list(keys[:num_hits])
        slot_ids = self._pin(owner, head, now)
        self.manager.touch(head)
        self.counters.num_hit_chunks += num_hits
        may_promote = num_pending == 0 and num_hits < len(keys)
        return HeadLookup(slot_ids, num_pending, may_promote)

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

    def reserve_promotion(
        self, keys: Sequence[OffloadKey], now: float
    ) -> PrepareStoreOutput | None:
        """Slots for a secondary to read ``keys`` into (keys held already are skipped;
        ``store_threshold`` is not applied: the chunk was stored once)."""
        return self.prepare_store(PROMOTE_OWNER, keys, now, filtered=False)

    def finish_promotion(self, keys: Sequence[OffloadKey], done_keys: Sequence[OffloadKey]) -> None:
        """A promotion answered: ``done_keys`` are readable, the rest of ``keys`` are dropped."""
        done = set(done_keys)
        reserved = self.leases.take_stores(PROMOTE_OWNER, keys)  # an expired one is gone
        promoted = [key for key in reserved if key in done]
        self.manager.complete_store(promoted, success=True)
        self.manager.complete_store([k for k in reserved if k not in done], success=False)
        self.counters.num_promoted += len(promoted)
        self.counters.num_promote_failures += len(reserved) - len(promoted)

    def pin_ready_run(self, owner: str, keys: Sequence[OffloadKey], now: float) -> list[int]:
        """Pin the leading run of ``keys`` readable now (after a promotion) for ``owner``."""
        run = []
        for key in keys:
            if not self._is_ready(key):
                break
            run.append(key)
        self.counters.num_hit_chunks += len(run)
        return self._pin(owner, run, now)

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
        self.manager.complete_load(expired.pins)
        self.manager.complete_store(expired.stores, success=False)
        self.counters.num_pins_expired += len(expired.pins)
        self.counters.num_stores_expired += len(expired.stores)
        self.manager.take_events()  # nobody reads them yet: keep them from piling up
        return expired.owners

    # -- helpers ----------------------------------------------------------------------------

    def _pin(self, owner: str, keys: Sequence[OffloadKey], now: float) -> list[int]:
        slot_ids = self.manager.prepare_load(keys)
        self.leases.add_pins(owner, keys, now)
        return slot_ids

    def _is_ready(self, key: OffloadKey) -> bool:
        chunk = self.manager.chunks.get(key)
        return chunk is not None and chunk.is_ready
