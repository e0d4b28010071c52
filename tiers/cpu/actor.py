"""The CPU tier actor: the gateway tier of a host's KV offload (``bus.messages.offload``).

It owns the host's shared-memory region (made at the first ``TierAttach``: one slot per chunk,
``cpu_bytes_to_use // slot_bytes`` slots, named after this incarnation) and keeps its books
(``CpuTierBooks``: the ``OffloadManager`` and who holds what); the workers of engine cores copy
the bytes. Behind it, in order, the secondary tiers of ``secondary_tier_ids``: a lookup that
misses here asks them and promotes what they hold into reserved slots; a store that lands here
is cascaded to each of them.

A lookup that meets a promotion in flight (another lookup's, of chunks its prefix goes on with)
waits for it, pins for its own owner what it brought and goes on with the rest of its prefix:
a chunk is promoted once, however many lookups want it. This is vLLM's RETRY answered inside
the tier: the engine core's lookup is already asynchronous (its request is parked meanwhile), so
a reply is always final, never "ask again". A promotion whose answer timed out is waited for no
more (its slots stay reserved, pending, until just past its deadline). Chunks an engine core
is still storing are not waited for either: their copy lands with that engine core's next step,
whenever that comes (a long prefill; a stalled or dead engine core holds them until its lease
ends), so the reply counts them in ``num_pending`` and the requester recomputes them.

Every pin and pending store has a lease (``lease_s``); a periodic sweep hands back the expired
ones, so a dead engine core, or a secondary whose answer never came, leaks no slot. A
``TierRelease`` or ``TierRenew`` naming another region generation than this one's (meant for an
earlier incarnation of the tier) is ignored; one naming none (an older sender) is applied as if
it named this one.

Every cascade and promotion carries a ``deadline`` (wall clock): the instant, well inside the
lease of its pins or reserved slots, after which the secondary must touch none of its slots.
Cascades are bounded per secondary (``max_cascades_in_flight``, promotions counted too): past
that, stores are dropped and counted, loads never. A job whose answer timed out may still be
running there: its pins or reserved slots are held, and it stays counted, until a little past its
deadline (``_DEADLINE_MARGIN_S``), then handed back (a failed job).

Every wait on a secondary is bounded, and one lookup's waits together (on the secondaries'
lookups and promotions, its own or others' in flight) fit in ``promote_budget_s``, by default
half the engine core's ``kv_lookup_timeout_s``: the lookup is answered while the engine core
still waits for it.

Every inbound message is a request; ``TierRelease`` may also come as a plain publish (asked, it
is answered with ``TierJobDone`` naming the stores that became readable), and ``TierRenew``
always does (never answered: it extends its owner's leases). Before the first ``TierAttach``
there is no region: lookups and stores get a ``TierError``, releases change nothing. In kv
routing it publishes its chunks' KV events, medium "cpu" (``tiers.tier_events``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shoal.bus.base import Bus
from shoal.bus.codec import Codec
from shoal.bus.messages.offload import (
    KVLayout,
    TierAttach,
    TierAttached,
    TierError,
    TierInbound,
    TierJobDone,
    TierLookup,
    TierLookupReply,
    TierPrepareStore,
    TierRelease,
    TierRenew,
    TierReply,
    TierStoreSlots,
)
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import Actor, Inbox
from shoal.config.deployment import KVTransferConfig, ShoalConfig
from shoal.tiers.books.backpressure import StoreBackpressure
from shoal.tiers.books.cpu_books import CpuTierBooks, Promotion
from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.books.manager import OffloadManager
from shoal.tiers.cpu.promotion_waits import PromotionWaits
from shoal.tiers.cpu.region import SharedRegion
from shoal.tiers.cpu.secondaries import SecondaryFailed, SecondaryLink, SecondaryTimeout
from shoal.tiers.tier_events import TierEvents, tier_events_settings, watch_manager

log = logging.getLogger(__name__)

_INBOUND: Codec[TierInbound] = Codec(TierInbound)
_MIN_WAIT_S = 0.01  # less budget than this left: ask no further secondary
_DEADLINE_MARGIN_S = 0.5  # a job's slots are freed this long after its deadline (wall clock)


async def _past(deadline: float) -> None:
    """Sleep until a little past ``deadline`` (``time.time()``): a secondary whose answer did
    not come touches none of the job's slots after it."""
    await asyncio.sleep(max(0.0, deadline - time.time() + _DEADLINE_MARGIN_S))


class CpuTierActor(Actor):
    """Serves ``TierInbound`` on ``subjects.tier_in(tier_id)`` (default: ``cpu_tier_id``)."""

    kind = "tier"

    def __init__(
        self,
        bus: Bus,
        tier_id: str | None = None,
        *,
        config: ShoalConfig | None = None,  # the deployment's (as a process: its JSON)
        kv_config: KVTransferConfig | None = None,  # or only its KV transfer group ...
        namespace: str = "shoal",  # ... and the subjects' namespace
        lease_s: float = 30.0,
        sweep_interval_s: float | None = None,  # default lease_s / 4
        secondary_timeout_s: float | None = None,  # attach and lookup; default a quarter of
        # kv_lookup_timeout_s; one lookup's waits on every secondary together take at most
        # twice this (promote_budget_s: half the engine core's wait by default)
        cascade_timeout_s: float | None = None,  # default lease_s / 3
        max_cascades_in_flight: int = 4,  # per secondary; more are dropped
        secondary_retry_s: float = 1.0,  # a detached secondary is attached again this often
        region_directory: str | Path | None = None,  # default /dev/shm (or the temp directory)
        kv_events_snapshot_interval_s: float | None = None,  # publish KV events (tier_events);
        # default: the config's interval when it routes by prefix, else none published
        heartbeat_interval_s: float = 1.0,
        drain_timeout_s: float = 5.0,
    ) -> None:
        if (config is None) == (kv_config is None):
            raise ValueError(
                "CpuTierActor takes exactly one of config (a ShoalConfig) and kv_config"
            )
        if config is not None:
            kv, namespace = config.kv_transfer_config, config.bus_config.namespace
        else:
            assert kv_config is not None
            kv = kv_config
        super().__init__(
            bus,
            tier_id or kv.cpu_tier_id,
            namespace=namespace,
            heartbeat_interval_s=heartbeat_interval_s,
            drain_timeout_s=drain_timeout_s,
        )
        self.kv_config = kv
        self.lease_s = lease_s
        self.sweep_interval_s = sweep_interval_s or lease_s / 4
        self.lookup_timeout_s = secondary_timeout_s or kv.kv_lookup_timeout_s / 4
        self.promote_budget_s = 2 * self.lookup_timeout_s
        self.cascade_timeout_s = cascade_timeout_s or lease_s / 3
        secondary_ids = kv.secondary_tier_ids
        if secondary_ids and max(self.promote_budget_s, self.cascade_timeout_s) >= lease_s:
            raise ValueError(
                f"lease_s ({lease_s}) must outlast a promotion ({self.promote_budget_s} s) "
                f"and a cascade ({self.cascade_timeout_s} s)"
            )
        self.max_cascades_in_flight = max_cascades_in_flight
        self.region_directory = Path(region_directory) if region_directory else None
        self.links = [
            SecondaryLink(
                bus,
                secondary_id,
                self.subjects.tier_in(secondary_id),
                owner=self.actor_id,
                timeout_s=self.lookup_timeout_s,
                retry_s=secondary_retry_s,
            )
            for secondary_id in secondary_ids
        ]
        self.kv_events = self._make_kv_events(config, kv_events_snapshot_interval_s)
        # the secondaries stores cascade to (a peer-to-peer tier keeps none)
        self.cascade_links = [
            link
            for link, tier in zip(self.links, kv.secondary_tiers, strict=True)
            if tier.takes_stores
        ]
        # per secondary: its stores' latency, and whether to drop stores for now
        self.backpressure = {
            link.secondary_id: StoreBackpressure(kv.backpressure) for link in self.links
        }
        self.region: SharedRegion | None = None
        self.books: CpuTierBooks | None = None
        self.promotion_waits = PromotionWaits()
        self._tasks: set[asyncio.Task[object]] = set()

    def inboxes(self) -> Sequence[Inbox]:
        return [Inbox(self.subjects.tier_in(self.actor_id), self.on_request, _INBOUND)]

    async def on_start(self) -> None:
        self._spawn(self._sweep_loop())
        if self.kv_events is not None:
            self._spawn(self.kv_events.run(self.incarnation))

    async def on_stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.region is not None:
            self.region.close(unlink=True)
            self.region = None

    def load(self) -> dict[str, float]:
        if self.books is None:
            return {"usage": 0.0, "num_chunks": 0.0}
        manager, counters = self.books.manager, self.books.counters
        return {
            "usage": manager.usage,
            "num_chunks": float(manager.num_used_slots),
            "num_queries": float(manager.stats.num_queries),
            "num_hits": float(manager.stats.num_hits),
            "num_pins": float(self.books.leases.num_pins),
            "num_pending_stores": float(self.books.leases.num_stores),
            **{name: float(value) for name, value in asdict(counters).items()},
            **{  # per secondary, for /metrics (gateway.tiering_metrics)
                f"backpressure_dropped:{tier}": float(pressure.num_dropped)
                for tier, pressure in self.backpressure.items()
            },
        }

    # -- requests ---------------------------------------------------------------------------

    async def on_request(self, request: TierInbound, msg: Msg) -> TierReply | None:
        match request:
            case TierAttach(layout=layout, create=create):
                return await self._attach(layout, create)
        if self.books is None or self.region is None:
            if isinstance(request, TierRenew):
                return None
            if isinstance(request, TierRelease):
                return TierJobDone()  # nothing of this incarnation is held
            return TierError(f"tier {self.actor_id} has no region yet: send TierAttach first")
        match request:
            case TierLookup(owner=owner, keys=keys, tiers=tiers):
                return await self._lookup(owner, keys, tiers)
            case TierPrepareStore(owner=owner, keys=keys):
                return self._prepare_store(owner, keys)
            case TierRelease(generation=generation):
                if self._is_stale(generation):
                    return TierJobDone()
                return self._release(request)
            case TierRenew(owner=owner, keys=keys, generation=generation):
                if not self._is_stale(generation):
                    self.books.leases.renew(owner, keys, time.monotonic())
                return None
        return TierError(f"tier {self.actor_id} does not serve {type(request).__name__}")

    async def _attach(self, layout: KVLayout, create: bool = True) -> TierReply:
        if self.region is None and not create:
            return TierError(f"tier {self.actor_id} has no region yet")
        if self.region is None:
            num_slots = self.kv_config.cpu_bytes_to_use // layout.slot_bytes
            if num_slots < 1:
                return TierError(
                    f"cpu_bytes_to_use ({self.kv_config.cpu_bytes_to_use} bytes) holds no chunk "
                    f"of {layout.slot_bytes} bytes (the slot size of {layout}): raise it"
                )
            self.region = SharedRegion.create(
                self.subjects.namespace,
                self.actor_id,
                self.incarnation,
                num_slots,
                layout,
                self.region_directory,
            )
            kv = self.kv_config
            manager = OffloadManager(
                num_slots, kv.eviction_policy, kv.store_threshold, kv.max_tracker_size
            )
            watch_manager(self.kv_events, manager)
            self.books = CpuTierBooks(manager)
            log.info("%r: region %s, %d slots", self, self.region.ref.path, num_slots)
        elif layout != self.region.ref.layout:
            return TierError(
                f"tier {self.actor_id} holds chunks of layout {self.region.ref.layout}; "
                f"refused {layout}"
            )
        now = time.monotonic()
        await asyncio.gather(*(link.attach(layout, now) for link in self.links))
        return TierAttached(self.region.ref)

    async def _lookup(
        self, owner: str, keys: list[OffloadKey], tiers: list[str] | None = None
    ) -> TierLookupReply:
        """The leading chunks held here (pinned for ``owner``), then those promoted from the
        secondaries; ``tiers`` (a request's ``kv_load_tiers``) limits both: chunks held here
        count only with ``cpu`` in it, a secondary is asked only if its type is.

        Where the prefix goes on with chunks another lookup is promoting, it waits for that
        promotion (vLLM's RETRY, answered here instead of by the engine core) and pins what
        became readable; then it goes on: further waits, promotions from the secondaries not
        asked yet. Every wait, its own and others' promotions, fits in ``promote_budget_s``."""
        books, region = self._books_and_region()
        use_held = tiers is None or "cpu" in tiers
        budget_end = time.monotonic() + self.promote_budget_s
        step = books.lookup_head(owner, keys, time.monotonic(), use_held=use_held)
        slot_ids = list(step.slot_ids)
        links = self._links_for(tiers)
        promoted: set[OffloadKey] = set()  # by this lookup (all it may take without "cpu")
        waited: set[int] = set()  # promotions waited for, each once
        while len(slot_ids) < len(keys) and budget_end - time.monotonic() >= _MIN_WAIT_S:
            rest = keys[len(slot_ids) :]
            if step.promotion is not None and step.promotion not in waited:
                waited.add(step.promotion)
                books.counters.num_promotion_waits += 1
                await self.promotion_waits.wait(step.promotion, budget_end - time.monotonic())
                step = books.lookup_more(owner, rest, time.monotonic(), reused=True)
            elif step.may_promote and (link := next(links, None)) is not None:
                promoted.update(await self._promote_from(link, rest, budget_end))
                only = None if use_held else promoted
                step = books.lookup_more(owner, rest, time.monotonic(), only=only)
            else:
                break
            slot_ids += step.slot_ids
        return TierLookupReply(
            region.ref.generation, slot_ids, step.num_pending, books.manager.usage
        )

    def _links_for(self, tiers: list[str] | None) -> Iterator[SecondaryLink]:
        """The secondaries a lookup may promote from, in order (each checked when reached)."""
        for link, tier in zip(self.links, self.kv_config.secondary_tiers, strict=True):
            if (tiers is None or tier.type in tiers) and self._usable(link):
                yield link

    async def _promote_from(
        self, link: SecondaryLink, keys: list[OffloadKey], budget_end: float
    ) -> list[OffloadKey]:
        """Ask ``link`` how many leading ``keys`` it holds and read those not held here into
        reserved slots (keys another promotion brings are left to it); the keys it promoted.
        Every wait ends by ``budget_end``; whoever waits for the promotion is woken at its end,
        however it ends."""
        books, region = self._books_and_region()
        timeout_s = min(self.lookup_timeout_s, budget_end - time.monotonic())
        num_held = await link.held(keys, timeout_s)
        left = budget_end - time.monotonic()
        if num_held == 0 or left < _MIN_WAIT_S:
            return []
        started = time.monotonic()
        promotion = books.reserve_promotion(keys[:num_held], started)
        if promotion is None:  # all held (or being promoted) here already, or no room
            return []
        self.promotion_waits.open(promotion.promotion_id)
        # past the wait nobody reads what it writes: it stops then (well inside the lease)
        deadline = time.time() + min(left, self.lease_s / 2)
        link.num_in_flight += 1
        try:
            reply = await link.promote(
                region.ref, promotion.keys, promotion.slot_ids, left, deadline
            )
        except SecondaryTimeout:
            # it may still write the slots until the deadline: they are freed just after it
            books.abandon_promotion(promotion)
            self._spawn(self._end_abandoned(link, promotion, deadline))
            return []
        except SecondaryFailed:
            link.num_in_flight -= 1
            return books.finish_promotion(promotion, [])
        except asyncio.CancelledError:  # the tier stops
            books.abandon_promotion(promotion)
            raise
        except BaseException:  # a bug of ours: the secondary may still write, as on a timeout
            books.abandon_promotion(promotion)
            self._spawn(self._end_abandoned(link, promotion, deadline))
            raise
        else:
            link.num_in_flight -= 1
            return books.finish_promotion(promotion, reply.done_keys)
        finally:  # after the books: a waiter woken finds the promotion's end in them
            books.counters.promote_time_s += time.monotonic() - started
            self.promotion_waits.close(promotion.promotion_id)

    def _prepare_store(self, owner: str, keys: list[OffloadKey]) -> TierStoreSlots:
        books, region = self._books_and_region()
        output = books.prepare_store(owner, keys, time.monotonic())
        generation, usage = region.ref.generation, books.manager.usage
        if output is None:
            return TierStoreSlots(generation, accepted=False, usage=usage)
        return TierStoreSlots(generation, output.keys_to_store, output.slot_ids, True, usage)

    def _release(self, release: TierRelease) -> TierJobDone:
        books, _ = self._books_and_region()
        stored = books.release(
            release.owner, release.loaded_keys, release.stored_keys, release.failed_keys
        )
        if stored:
            self._cascade(stored)
        return TierJobDone(done_keys=stored)

    # -- cascades ---------------------------------------------------------------------------

    def _cascade(self, keys: list[OffloadKey]) -> None:
        """Send newly stored chunks to every secondary that can take them now; drop the rest."""
        books, _ = self._books_and_region()
        for link in self.cascade_links:
            if not self._usable(link) or link.num_in_flight >= self.max_cascades_in_flight:
                books.counters.num_cascade_dropped += len(keys)
                continue
            if self.backpressure[link.secondary_id].should_drop_store(time.monotonic()):
                books.counters.num_cascade_dropped += len(keys)
                books.counters.num_backpressure_dropped += len(keys)
                continue
            now = time.monotonic()
            slot_ids = books.pin_for_cascade(keys, now)
            link.num_in_flight += 1
            self._spawn(self._run_cascade(link, keys, slot_ids, now))

    async def _run_cascade(
        self, link: SecondaryLink, keys: list[OffloadKey], slot_ids: list[int], pinned_at: float
    ) -> None:
        books, region = self._books_and_region()
        deadline = time.time() - (time.monotonic() - pinned_at) + self.lease_s / 2
        pressure = self.backpressure[link.secondary_id]
        try:
            reply = await link.cascade(region.ref, keys, slot_ids, self.cascade_timeout_s, deadline)
        except SecondaryTimeout:
            pressure.record_store(time.monotonic() - pinned_at, succeeded=False)
            # it may still read the slots until the deadline: pinned, and counted, until then
            try:
                await _past(deadline)
            finally:
                link.num_in_flight -= 1
                books.finish_cascade(keys, 0)
            return
        except SecondaryFailed:
            pressure.record_store(time.monotonic() - pinned_at, succeeded=False)
            link.num_in_flight -= 1
            books.finish_cascade(keys, 0)
            return
        link.num_in_flight -= 1
        pressure.record_store(time.monotonic() - pinned_at, succeeded=True)  # it answered
        books.finish_cascade(keys, len(set(reply.done_keys) & set(keys)))

    async def _end_abandoned(
        self, link: SecondaryLink, promotion: Promotion, deadline: float
    ) -> None:
        """A promotion whose answer never came may still run on the secondary until its
        deadline: its slots stay reserved, and it counted in ``num_in_flight``, until then."""
        try:
            await _past(deadline)
        finally:
            link.num_in_flight -= 1
            self._books_and_region()[0].finish_promotion(promotion, [])

    # -- helpers ----------------------------------------------------------------------------

    def _usable(self, link: SecondaryLink) -> bool:
        """Attached; a detached one is attached again in the background when it is due."""
        if link.is_attached:
            return True
        now = time.monotonic()
        if self.region is not None and link.claim_retry(now):
            self._spawn(link.attach(self.region.ref.layout, now))
        return False

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                self.sweep(time.monotonic())
                for link in self.links:
                    self._usable(link)  # an idle tier attaches its secondaries again too
            except Exception:  # a bug here must not end the sweeps: slots would leak
                log.exception("%r: sweep failed", self)

    def sweep(self, now: float) -> None:
        """Hand back every pin and pending store older than the lease."""
        if self.books is None:
            return
        owners = self.books.expire(now - self.lease_s)
        if owners:
            log.warning("%r: leases of %s expired", self, ", ".join(owners))

    def _is_stale(self, generation: str) -> bool:
        """Whether a release or renewal names another region than this one (its keys were
        granted by an earlier incarnation): ignored then. "" (an older sender) is not stale."""
        books, region = self._books_and_region()
        if not generation or generation == region.ref.generation:
            return False
        books.counters.num_stale_ignored += 1
        log.debug("%r: ignored a release or renewal of region %s", self, generation)
        return True

    def _make_kv_events(self, config: ShoalConfig | None, every: float | None) -> TierEvents | None:
        every, replicas = tier_events_settings(config, every)
        return TierEvents.make(
            self.bus, self.subjects, self.actor_id, "cpu", self._holdings, every, replicas
        )

    def _holdings(self) -> tuple[OffloadManager, int] | None:
        if self.books is None or self.region is None:
            return None
        layout = self.region.ref.layout
        return self.books.manager, layout.block_size * layout.blocks_per_chunk

    def _books_and_region(self) -> tuple[CpuTierBooks, SharedRegion]:
        assert self.books is not None and self.region is not None
        return self.books, self.region

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
