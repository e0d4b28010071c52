"""The replicas of an existing JetStream stream, read and changed through the JetStream API's
request subjects on any ``Bus`` connected to NATS (``shoal nats-init``: an existing bucket or
stream keeps its settings when opened, so a deployment moved to a cluster would otherwise keep
one copy of each). JSON in and out, as the API speaks it."""

from __future__ import annotations

import json
from typing import Any

from shoal.bus.base import Bus, BusError

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


async def set_stream_replicas(bus: Bus, stream: str, replicas: int) -> None:
    """Keep ``replicas`` copies of ``stream`` (JetStream moves its data; the rest of its
    configuration stays)."""
    config = (await _call(bus, "INFO", stream))["config"]
    await _call(bus, "UPDATE", stream, {**config, "num_replicas": replicas})
