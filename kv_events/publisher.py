"""Publishing one source's KV events (prefix routing): an engine core's prefix cache
(``engine.actor.kv_events_link``) or an offload tier's chunks (``tiers.tier_events``), as
``KVEventBatch``es on the source's subject, captured by the kv-events stream (opened here
before the first publish).

A snapshot is ``AllBlocksCleared`` then every hash held now, so a client drops what it knew of
the source and starts again from the truth. The first batch of each incarnation (``begin``:
``seq`` restarts at 0 with it) is one; so is a batch every ``snapshot_interval_s`` (``publish``
is also called when idle) and the first after the bus reconnects or a publish failed
(``snapshot_due``): whatever a client missed (events lost while JetStream was away, a gap it
saw) heals within one interval, and the stream always holds a recent snapshot of every source.
Events are cut into batches well under the bus's payload limit (``split_events``; consecutive
``seq``s, the first of a snapshot carrying the ``AllBlocksCleared``): a chunked message would
not survive the stream. Nothing is published when nothing changed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from shoal.bus.base import Bus
from shoal.bus.codec import encode
from shoal.bus.errors import BusError
from shoal.bus.messages.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from shoal.bus.subjects import Subjects
from shoal.kv_events.stream import open_kv_events_stream

log = logging.getLogger(__name__)
UNIT_BYTES = 64  # a hash (<= 32 bytes) or an event's tag and parent hash, encoded, with room
DEFAULT_MAX_UNITS = 8192  # per batch on a bus without a payload limit


def max_units_for(max_payload: int | None) -> int:
    """Units (``split_events``) per batch for a bus whose payloads stop at ``max_payload``:
    half of it, the rest left for the batch's own fields."""
    if not max_payload:
        return DEFAULT_MAX_UNITS
    return max(2, max_payload // 2 // UNIT_BYTES)


def split_events(events: list[KVEvent], max_units: int) -> list[list[KVEvent]]:
    """``events`` cut into runs of at most ``max_units`` units each (one batch per run, so no
    batch outgrows the bus's payload limit), in order: a hash is a unit, and so is each event
    (its tag and parent hash). A long event is cut into pieces; a ``BlockStored`` piece has the
    last hash of the piece before it as parent. Replaying the runs in order replays ``events``."""
    max_units = max(2, max_units)
    runs: list[list[KVEvent]] = [[]]
    room = max_units
    for event in events:
        hashes = [] if isinstance(event, AllBlocksCleared) else event.block_hashes
        start = 0
        while True:
            if room < (2 if hashes else 1):
                runs.append([])
                room = max_units
            piece = hashes[start : start + room - 1]
            runs[-1].append(_piece(event, piece, hashes[start - 1] if start else None))
            start += len(piece)
            room -= 1 + len(piece)
            if start >= len(hashes):
                break
    return runs if runs[0] else []


def _piece(event: KVEvent, hashes: list[bytes], parent: bytes | None) -> KVEvent:
    match event:
        case AllBlocksCleared():
            return event
        case BlockRemoved():
            return BlockRemoved(hashes, event.medium)
        case BlockStored():
            parent = parent if parent is not None else event.parent_block_hash
            return BlockStored(hashes, parent, event.block_size, event.medium)


class KvEventsPublisher:
    """Publishes the batches of the source ``source_id`` on ``subject`` (``what`` names the
    source in logs)."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        subject: str,
        source_id: str,
        *,
        replicas: int = 1,
        snapshot_interval_s: float = 30.0,
        what: str = "source",
    ) -> None:
        self._bus = bus
        self._subjects = subjects
        self._subject = subject
        self.source_id = source_id
        self._replicas = replicas
        self.snapshot_interval_s = snapshot_interval_s
        self._what = f"{what} {source_id}"
        self.incarnation = ""
        self._last_snapshot = 0.0
        self._snapshot_due = True
        self._unlisten: Callable[[], None] | None = None
        self.seq = 0
        self.num_published = 0
        self.num_snapshots = 0

    async def start(self) -> None:
        self._unlisten = self._bus.on_reconnect(self.want_snapshot)
        try:
            await open_kv_events_stream(
                self._bus, self._subjects, self._replicas, self.snapshot_interval_s
            )
        except (BusError, NotImplementedError, OSError) as exc:
            # Live clients still hear the events; a restarted one starts with an empty index.
            log.warning("%s: kv-events stream not opened: %r", self._what, exc)

    def stop(self) -> None:
        unlisten, self._unlisten = self._unlisten, None
        if unlisten is not None:
            unlisten()

    def begin(self, incarnation: str) -> None:
        """A new incarnation of the source: ``seq`` restarts, and its first batch is a
        snapshot."""
        self.incarnation, self.seq, self._snapshot_due = incarnation, 0, True

    def want_snapshot(self) -> None:
        """The next batch is a snapshot (a reconnect: what was sent meanwhile may be lost; or
        the source's contents were replaced)."""
        self._snapshot_due = True

    def snapshot_due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self._snapshot_due or now - self._last_snapshot >= self.snapshot_interval_s

    def _max_units(self) -> int:
        try:
            return max_units_for(getattr(self._bus, "max_payload", None))
        except BusError:  # not connected: the publish will say so
            return DEFAULT_MAX_UNITS

    async def publish(self, events: list[KVEvent], snapshot: Callable[[], list[KVEvent]]) -> None:
        """Publish ``events`` (taken since the last call: nothing if none), or ``snapshot()``
        instead when one is due (it supersedes them)."""
        now = time.monotonic()
        if self.snapshot_due(now):
            events = snapshot()
            self._last_snapshot, self._snapshot_due = now, False
            self.num_snapshots += 1
        for run in split_events(events, self._max_units()):
            batch = KVEventBatch(self.source_id, self.incarnation, self.seq, run, time.time())
            self.seq += 1
            try:
                await self._bus.publish(self._subject, encode(batch))
                self.num_published += 1
            except BusError as exc:
                self._snapshot_due = True  # clients see the gap; the next batch repairs it
                log.warning("%s: kv events lost: %r", self._what, exc)
