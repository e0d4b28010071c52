"""The replicas and subjects of an existing JetStream stream, read and changed through the
JetStream API's request subjects on any ``Bus`` connected to NATS (``shoal nats-init``: an
existing bucket or stream keeps its settings when opened, so a deployment moved to a cluster
would otherwise keep one copy of each, and a stream made by an older shoal would not capture a
subject added since). JSON in and out, as the API speaks it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from shoal.bus.base import Bus
from shoal.bus.errors import BusError

API = "$JS.API.STREAM"
TIMEOUT_S = 5.0


async def _call(bus: Bus, action: str, stream: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else b""
    reply = await bus.request(f"{API}.{action}.{stream}", data, timeout=TIMEOUT_S)
    answer = json.loads(reply.data)
    if "error" in answer:
        error = answer["error"]
        raise BusError(
            f"JetStream {action.lower()} of stream {stream!r}: {error.get('description')}"
        )
    return answer


async def stream_replicas(bus: Bus, stream: str) -> int:
    """How many copies the cluster keeps of ``stream``."""
    info = await _call(bus, "INFO", stream)
    return int(info["config"].get("num_replicas", 1))


async def set_stream_replicas(
    bus: Bus, stream: str, replicas: int, *, settle_timeout_s: float = 60.0
) -> None:
    """Keep ``replicas`` copies of ``stream`` (the rest of its configuration stays), waiting
    until the cluster has them: a leader and ``replicas - 1`` current followers (until then a
    write to it may time out)."""
    config = (await _call(bus, "INFO", stream))["config"]
    await _call(bus, "UPDATE", stream, {**config, "num_replicas": replicas})
    deadline = time.monotonic() + settle_timeout_s
    while not _settled(await _call(bus, "INFO", stream), replicas):
        if time.monotonic() > deadline:
            raise BusError(
                f"stream {stream!r}: {replicas} replicas not in place after "
                f"{settle_timeout_s:.0f} s"
            )
        await asyncio.sleep(0.2)


async def add_stream_subjects(bus: Bus, stream: str, subjects: list[str]) -> list[str]:
    """Make ``stream`` capture ``subjects`` too (the rest of its configuration stays); the
    subjects added (none: it had them all)."""
    config = (await _call(bus, "INFO", stream))["config"]
    kept = list(config.get("subjects") or [])
    missing = [subject for subject in subjects if subject not in kept]
    if missing:
        await _call(bus, "UPDATE", stream, {**config, "subjects": kept + missing})
    return missing


def _settled(info: dict[str, Any], replicas: int) -> bool:
    cluster = info.get("cluster") or {}
    followers = [r for r in cluster.get("replicas", []) if r.get("current")]
    return bool(cluster.get("leader")) and len(followers) == replicas - 1
