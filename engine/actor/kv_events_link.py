"""Publishes an engine core's KV events (prefix routing): once per step, the events its block
pool logged since the last one, as one ``KVEventBatch`` on ``Subjects.kv_events(engine_id)``,
captured by the kv-events stream (opened here before the first publish).

The first batch of each incarnation of the actor, and the first for a new ``EngineCore`` (a
rebuilt cache), is a snapshot: ``AllBlocksCleared`` then every hash cached now, so a client
drops what it knew of this engine core and starts again from the truth. ``seq`` restarts at 0
with it. Nothing is published for a step that changed nothing.
"""

from __future__ import annotations

import logging
import time

from shoal.bus.base import Bus, BusError
from shoal.bus.codec import encode
from shoal.bus.event_stream import open_kv_events_stream
from shoal.bus.messages.kv_events import KVEvent, KVEventBatch
from shoal.bus.subjects import Subjects
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.core.kv_events import snapshot_events

log = logging.getLogger(__name__)


class KvEventsLink:
    def __init__(self, bus: Bus, subjects: Subjects, engine_id: str, replicas: int = 1) -> None:
        self._bus = bus
        self._subjects = subjects
        self._subject = subjects.kv_events(engine_id)
        self._engine_id = engine_id
        self._replicas = replicas
        self._core: EngineCore | None = None
        self._incarnation = ""
        self.seq = 0
        self.num_published = 0

    async def start(self) -> None:
        try:
            await open_kv_events_stream(self._bus, self._subjects, self._replicas)
        except (BusError, NotImplementedError, OSError) as exc:
            # Live clients still hear the events; a restarted one starts with an empty index.
            log.warning("engine %s: kv-events stream not opened: %r", self._engine_id, exc)

    def _take(self, core: EngineCore, incarnation: str) -> list[KVEvent]:
        kv = core.scheduler.kv_cache_manager
        if core is self._core and incarnation == self._incarnation:
            events_log = kv.block_pool.kv_events
            return events_log.take() if events_log is not None else []
        events_log = kv.record_kv_events()
        if events_log is None:
            return []  # no prefix caching: nothing to tell
        events_log.take()  # superseded by the snapshot
        self._core, self._incarnation, self.seq = core, incarnation, 0
        return snapshot_events(list(kv.block_pool.cached_blocks), kv.block_size)

    async def publish(self, core: EngineCore | None, incarnation: str) -> None:
        """Publish what ``core``'s cache did since the last call (nothing if nothing)."""
        if core is None:
            return
        events = self._take(core, incarnation)
        if not events:
            return
        batch = KVEventBatch(self._engine_id, incarnation, self.seq, events, time.time())
        self.seq += 1
        try:
            await self._bus.publish(self._subject, encode(batch))
            self.num_published += 1
        except BusError as exc:
            log.warning("engine %s: kv events lost: %r", self._engine_id, exc)
