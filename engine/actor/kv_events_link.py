"""Publishes an engine core's KV events (prefix routing): once per step, the events its block
pool logged since the last one, on ``Subjects.kv_events(engine_id)`` through a
``kv_events.publisher.KvEventsPublisher`` (seq, snapshots, payload limit, the stream).

The first batch of each incarnation of the actor, and the first for a new ``EngineCore`` (a
rebuilt cache), is a snapshot of every hash cached now (``seq`` restarts at 0 with it); so is
one every snapshot interval and after a reconnect or a failed publish.
"""

from __future__ import annotations

from shoal.bus.base import Bus
from shoal.bus.subjects import Subjects
from shoal.engine.core.engine_core import EngineCore
from shoal.kv_events.publisher import KvEventsPublisher


class KvEventsLink:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        engine_id: str,
        replicas: int = 1,
        snapshot_interval_s: float = 30.0,
    ) -> None:
        self.publisher = KvEventsPublisher(
            bus,
            subjects,
            subjects.kv_events(engine_id),
            engine_id,
            replicas=replicas,
            snapshot_interval_s=snapshot_interval_s,
            what="engine",
        )
        self._core: EngineCore | None = None

    @property
    def num_published(self) -> int:
        return self.publisher.num_published

    @property
    def num_snapshots(self) -> int:
        return self.publisher.num_snapshots

    async def start(self) -> None:
        await self.publisher.start()

    def stop(self) -> None:
        self.publisher.stop()

    async def publish(self, core: EngineCore | None, incarnation: str) -> None:
        """Publish what ``core``'s cache did since the last call (nothing if nothing), or a
        snapshot when one is due."""
        if core is None:
            return
        fresh = core is not self._core or incarnation != self.publisher.incarnation
        events = core.take_kv_events(restart=fresh)
        if events is None:
            return  # no prefix caching: nothing to tell
        if fresh:
            self._core = core
            self.publisher.begin(incarnation)
        await self.publisher.publish(events, core.kv_snapshot)
