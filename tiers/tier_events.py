"""An offload tier's KV events (prefix routing): the chunks that became readable in it and
those that left, as vLLM's offloading events, published on ``Subjects.tier_kv_events(tier_id)``
through a ``kv_events.publisher.KvEventsPublisher`` (seq, snapshots, payload limit, the
kv-events stream) so engine clients know which prefixes a host's CPU tier holds.

The tier's ``OffloadManager`` logs ``OffloadEvent``s; every ``flush_interval_s`` (coalesced:
one batch for whatever changed meanwhile, none when nothing did) they become ``BlockStored``
(then ``BlockRemoved``, as ``take_events`` orders them) with ``medium`` the tier's type, the
chunks' keys as block hashes (the KV cache group index stripped, repeats dropped) and
``block_size`` the tokens of a chunk. As stores come before removals in a take, a key removed
then stored again within one flush would read as removed: a removal of a key readable now is
left out. A snapshot (``AllBlocksCleared``, then every readable key) comes when the tier starts
(its incarnation: a restart is a new one), when it attaches a new region or layout
(``replaced``), every snapshot interval and after a reconnect. Published only when the
deployment routes by prefix (``kv_events_interval``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from shoal.bus.base import Bus
from shoal.bus.messages.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    snapshot_events,
)
from shoal.bus.subjects import Subjects
from shoal.config.deployment import ShoalConfig
from shoal.kv_events.publisher import KvEventsPublisher
from shoal.tiers.books.keys import OffloadKey, get_offload_block_hash
from shoal.tiers.books.manager import OffloadEvent, OffloadManager

log = logging.getLogger(__name__)
FLUSH_INTERVAL_S = 0.1  # a tier's events wait at most this long (coalesced into one batch)

# What a tier holds now: its manager and the tokens of a chunk (None: nothing attached).
Holdings = Callable[[], tuple[OffloadManager, int] | None]


def kv_events_interval(config: ShoalConfig) -> float | None:
    """The snapshot interval of the deployment's KV events when it publishes them (routing
    mode kv, as the engine cores decide), else None: its tiers publish nothing."""
    if config.resolved_routing_mode != "kv":
        return None
    return config.parallel_config.kv_events_snapshot_interval_s


def tier_events_settings(
    config: ShoalConfig | None, interval: float | None
) -> tuple[float | None, int]:
    """A tier's KV-event snapshot interval (``interval``, else the config's when it routes by
    prefix) and the replicas of the stream it may create."""
    if config is None:
        return interval, 1
    return interval or kv_events_interval(config), config.bus_config.jetstream_replicas


def _hashes(keys: tuple[OffloadKey, ...] | list[OffloadKey]) -> list[bytes]:
    return list(dict.fromkeys(get_offload_block_hash(key) for key in keys))


def to_kv_events(
    events: list[OffloadEvent], manager: OffloadManager, tokens_per_chunk: int, medium: str
) -> list[KVEvent]:
    """``events`` (``take_events``'s) as KV events; see the module doc."""
    out: list[KVEvent] = []
    for event in events:
        if not event.removed:
            out.append(BlockStored(_hashes(event.keys), None, tokens_per_chunk, medium))
            continue
        readable = manager.chunks
        gone = [k for k in event.keys if k not in readable or not readable[k].is_ready]
        if gone:
            out.append(BlockRemoved(_hashes(gone), medium))
    return out


def tier_snapshot(holdings: tuple[OffloadManager, int] | None, medium: str) -> list[KVEvent]:
    """Every readable chunk (nothing attached: none)."""
    if holdings is None:
        return [AllBlocksCleared()]
    manager, tokens_per_chunk = holdings
    ready = [key for key, chunk in manager.chunks.items() if chunk.is_ready]
    return snapshot_events(_hashes(ready), tokens_per_chunk, medium)


class TierEvents:
    """Publishes one tier's events while ``run`` runs (a task of the tier actor)."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        tier_id: str,
        medium: str,
        holdings: Holdings,
        *,
        snapshot_interval_s: float,
        replicas: int = 1,
        flush_interval_s: float = FLUSH_INTERVAL_S,
    ) -> None:
        self.medium = medium
        self.flush_interval_s = flush_interval_s
        self._holdings = holdings
        self.publisher = KvEventsPublisher(
            bus,
            subjects,
            subjects.tier_kv_events(tier_id),
            tier_id,
            replicas=replicas,
            snapshot_interval_s=snapshot_interval_s,
            what="tier",
        )

    @classmethod
    def make(
        cls,
        bus: Bus,
        subjects: Subjects,
        tier_id: str,
        medium: str,
        holdings: Holdings,
        interval: float | None,
        replicas: int = 1,
    ) -> TierEvents | None:
        """A tier's events when the deployment publishes them (``interval`` set), else None."""
        if not interval:
            return None
        return cls(
            bus,
            subjects,
            tier_id,
            medium,
            holdings,
            snapshot_interval_s=interval,
            replicas=replicas,
        )

    def replaced(self) -> None:
        """The tier holds another region or layout now: its next batch is a snapshot."""
        self.publisher.want_snapshot()

    async def flush(self) -> None:
        """Publish what changed since the last flush, or a snapshot when one is due."""
        held = self._holdings()
        events: list[KVEvent] = []
        if held is not None:
            manager, tokens_per_chunk = held
            events = to_kv_events(manager.take_events(), manager, tokens_per_chunk, self.medium)
        await self.publisher.publish(events, lambda: tier_snapshot(held, self.medium))

    async def run(self, incarnation: str) -> None:
        """Open the stream, then flush every ``flush_interval_s`` until cancelled (the tier's
        incarnation ``incarnation`` begins with a snapshot)."""
        await self.publisher.start()
        self.publisher.begin(incarnation)
        try:
            while True:
                try:
                    await self.flush()
                except Exception:  # a bug here must not end the tier's events
                    log.exception("tier %s: kv events not published", self.publisher.source_id)
                await asyncio.sleep(self.flush_interval_s)
        finally:
            self.publisher.stop()


def watch_manager(events: TierEvents | None, manager: OffloadManager) -> None:
    """A tier's new manager (a new region or layout): its events are logged and published (a
    snapshot first) when the tier publishes them (``events``), else not even logged."""
    manager.records_events = events is not None
    if events is not None:
        events.replaced()
