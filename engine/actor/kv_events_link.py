"""Publishes an engine core's KV events (prefix routing): once per step, the events its block
pool logged since the last one, as ``KVEventBatch``es on ``Subjects.kv_events(engine_id)``,
captured by the kv-events stream (opened here before the first publish).

A snapshot is ``AllBlocksCleared`` then every hash cached now, so a client drops what it knew
of this engine core and starts again from the truth. The first batch of each incarnation of
the actor, and the first for a new ``EngineCore`` (a rebuilt cache), is one (``seq`` restarts
at 0 with it); so is a batch every ``snapshot_interval_s`` (``publish`` is also called when
idle) and the first after the bus reconnects or a publish failed: whatever a client missed
(events lost while JetStream was away, a gap it saw) heals within one interval, and the
stream always holds a recent snapshot of every engine core. Events are cut into batches well
under the bus's payload limit (``split_events``; consecutive ``seq``s, the first of a
snapshot carrying the ``AllBlocksCleared``): a chunked message would not survive the stream.
Nothing is published for a step that changed nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from shoal.bus.base import Bus, BusError
from shoal.bus.codec import encode
from shoal.bus.event_stream import open_kv_events_stream
from shoal.bus.messages.kv_events import KVEvent, KVEventBatch
from shoal.bus.subjects import Subjects
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.core.kv_events import snapshot_events, split_events

log = logging.getLogger(__name__)
UNIT_BYTES = 64  # a hash (<= 32 bytes) or an event's tag and parent hash, encoded, with room
DEFAULT_MAX_UNITS = 8192  # per batch on a bus without a payload limit


def max_units_for(max_payload: int | None) -> int:
    """Units (``split_events``) per batch for a bus whose payloads stop at ``max_payload``:
    half of it, the rest left for the batch's own fields."""
    if not max_payload:
        return DEFAULT_MAX_UNITS
    return max(2, max_payload // 2 // UNIT_BYTES)


class KvEventsLink:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        engine_id: str,
        replicas: int = 1,
        snapshot_interval_s: float = 30.0,
    ) -> None:
        self._bus = bus
        self._subjects = subjects
        self._subject = subjects.kv_events(engine_id)
        self._engine_id = engine_id
        self._replicas = replicas
        self.snapshot_interval_s = snapshot_interval_s
        self._core: EngineCore | None = None
        self._incarnation = ""
        self._last_snapshot = 0.0
        self._snapshot_due = False
        self._unlisten: Callable[[], None] | None = None
        self.seq = 0
        self.num_published = 0
        self.num_snapshots = 0

    async def start(self) -> None:
        self._unlisten = self._bus.on_reconnect(self._on_reconnect)
        try:
            await open_kv_events_stream(
                self._bus, self._subjects, self._replicas, self.snapshot_interval_s
            )
        except (BusError, NotImplementedError, OSError) as exc:
            # Live clients still hear the events; a restarted one starts with an empty index.
            log.warning("engine %s: kv-events stream not opened: %r", self._engine_id, exc)

    def stop(self) -> None:
        unlisten, self._unlisten = self._unlisten, None
        if unlisten is not None:
            unlisten()

    def _on_reconnect(self) -> None:
        self._snapshot_due = True  # what was sent while the connection was down may be lost

    def _take(self, core: EngineCore, incarnation: str) -> list[KVEvent]:
        kv = core.scheduler.kv_cache_manager
        fresh = core is not self._core or incarnation != self._incarnation
        events_log = kv.record_kv_events() if fresh else kv.block_pool.kv_events
        if events_log is None:
            return []  # no prefix caching: nothing to tell
        now = time.monotonic()
        periodic = now - self._last_snapshot >= self.snapshot_interval_s
        if not (fresh or self._snapshot_due or periodic):
            return events_log.take()
        events_log.take()  # superseded by the snapshot
        if fresh:
            self._core, self._incarnation, self.seq = core, incarnation, 0
        self._last_snapshot, self._snapshot_due = now, False
        self.num_snapshots += 1
        return snapshot_events(list(kv.block_pool.cached_blocks), kv.block_size)

    def _max_units(self) -> int:
        try:
            return max_units_for(getattr(self._bus, "max_payload", None))
        except BusError:  # not connected: the publish will say so
            return DEFAULT_MAX_UNITS

    async def publish(self, core: EngineCore | None, incarnation: str) -> None:
        """Publish what ``core``'s cache did since the last call (nothing if nothing), or a
        snapshot when one is due."""
        if core is None:
            return
        events = self._take(core, incarnation)
        for run in split_events(events, self._max_units()):
            batch = KVEventBatch(self._engine_id, incarnation, self.seq, run, time.time())
            self.seq += 1
            try:
                await self._bus.publish(self._subject, encode(batch))
                self.num_published += 1
            except BusError as exc:
                self._snapshot_due = True  # clients see the gap; the next batch repairs it
                log.warning("engine %s: kv events lost: %r", self._engine_id, exc)
