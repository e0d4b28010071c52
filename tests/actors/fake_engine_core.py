"""A stand-in engine core for the engine client's actor tests: it publishes stats, heartbeats,
status events and step outputs as one would, and records the adds and aborts it is sent."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shoal.bus.codec import Codec, encode
from shoal.bus.messages.control import ActorState, Heartbeat, StatusEvent
from shoal.bus.messages.engine import (
    AbortRequest,
    AddRequest,
    EngineCoreOutput,
    EngineInbound,
    EngineOutputs,
    EngineStats,
    SchedulerStats,
)
from shoal.bus.msg import Msg
from shoal.bus.subjects import Subjects
from shoal.bus.transport.memory import InMemoryBus

INBOUND: Codec[EngineInbound] = Codec(EngineInbound)


@dataclass
class FakeEngine:
    """Publishes stats and control events as one engine core would; records its inbox."""

    bus: InMemoryBus
    subjects: Subjects
    engine_id: str
    adds: dict[str, AddRequest] = field(default_factory=dict)  # by request id, in order
    aborts: list[str] = field(default_factory=list)
    seq: int = 0

    async def start(self) -> None:
        await self.bus.subscribe(self.subjects.engine_in(self.engine_id), self._on_inbound)

    async def _on_inbound(self, msg: Msg) -> None:
        match INBOUND.decode(msg.data):
            case AddRequest() as add:
                self.adds[add.request_id] = add
            case AbortRequest(request_ids=ids):
                self.aborts.extend(ids)

    async def stats(self, incarnation: str) -> None:
        stats = EngineStats(self.engine_id, SchedulerStats(), time.time(), 1024, 64, 16)
        stats.incarnation = incarnation
        await self.bus.publish(self.subjects.engine_stats(self.engine_id), encode(stats))

    async def heartbeat(self, incarnation: str) -> None:
        self.seq += 1
        beat = Heartbeat(
            self.engine_id, "engine", self.seq, ActorState.READY, time.time(), {}, incarnation
        )
        await self.bus.publish(self.subjects.heartbeat("engine"), encode(beat))

    async def status(self, state: ActorState, incarnation: str = "") -> None:
        event = StatusEvent(self.engine_id, "engine", state, time.time(), "", incarnation)
        await self.bus.publish(self.subjects.status("engine"), encode(event))

    async def outputs(self, client_id: str, outputs: list[EngineCoreOutput]) -> None:
        """One step's ``outputs`` for the client ``client_id``."""
        step = EngineOutputs(self.engine_id, outputs, time.time())
        await self.bus.publish(self.subjects.engine_out(client_id), encode(step))
