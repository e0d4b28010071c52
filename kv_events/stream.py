"""The kv-events stream (``bus.event_stream`` on the deployment's subjects): every engine core's
and KV tier's KV events, which prefix-aware routing replays; its subjects and retention."""

from __future__ import annotations

from shoal.bus.base import Bus
from shoal.bus.event_stream import EventStream
from shoal.bus.subjects import Subjects

# The prefix-routing stream: engine cores publish about one batch per busy step and a full
# snapshot every snapshot interval, KV tiers a batch per short moment that changed them and a
# snapshot as often; a client replays what is left of it on start. Retention is per source (one
# subject each), so a busy one cannot push another's snapshot out, and a few snapshot intervals
# long: older batches are superseded by a later snapshot.
KV_EVENTS_MAX_MSGS_PER_ENGINE = 20_000
KV_EVENTS_SNAPSHOTS_KEPT = 4


def kv_events_subjects(subjects: Subjects) -> list[str]:
    """What the kv-events stream captures."""
    return [subjects.kv_events("*"), subjects.tier_kv_events("*")]


async def open_kv_events_stream(
    bus: Bus, subjects: Subjects, replicas: int = 1, snapshot_interval_s: float = 30.0
) -> EventStream:
    """The stream of every engine core's and KV tier's KV events (opened by them and clients;
    the first to create it sets its retention and subjects: ``shoal nats-init`` adds those
    missing from an older one)."""
    return await bus.open_stream(
        subjects.kv_events_stream(),
        kv_events_subjects(subjects),
        max_age_s=KV_EVENTS_SNAPSHOTS_KEPT * snapshot_interval_s,
        max_msgs_per_subject=KV_EVENTS_MAX_MSGS_PER_ENGINE,
        replicas=replicas,
    )
