"""Driving faults from a test: inject one into an engine core or a worker, send recovery
commands, and talk to an engine core as a bare client (to see its raw outputs, such as the
``resumable`` flag, without the engine client acting on them)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from shoal.bus.base import Bus
from shoal.bus.codec import Codec, encode
from shoal.bus.messages.engine import (
    AddRequest,
    EngineCoreOutput,
    EngineOutbound,
    EngineOutputs,
    RequestRejected,
)
from shoal.bus.messages.fault import (
    RETRY,
    EngineControlReply,
    FaultInjected,
    FaultToleranceRequest,
    FaultToleranceResult,
    InjectFault,
)
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import call
from shoal.bus.subjects import Subjects

_REPLY: Codec[EngineControlReply] = Codec(EngineControlReply)
_OUTBOUND: Codec[EngineOutbound] = Codec(EngineOutbound)


async def inject_engine_fault(
    bus: Bus, subjects: Subjects, engine_id: str, after_steps: int = 0
) -> FaultInjected:
    reply = await call(
        bus, subjects.control("engine", engine_id), InjectFault(after_steps), _REPLY, timeout=10
    )
    assert isinstance(reply, FaultInjected), reply
    return reply


async def send_instruction(
    bus: Bus, subjects: Subjects, engine_id: str, instruction: str = RETRY, timeout: float = 60
) -> FaultToleranceResult:
    request = FaultToleranceRequest(instruction, request_id=f"ft-{uuid.uuid4().hex[:8]}")
    reply = await call(bus, subjects.control("engine", engine_id), request, _REPLY, timeout=timeout)
    assert isinstance(reply, FaultToleranceResult), reply
    assert reply.request_id == request.request_id
    return reply


@dataclass
class BareClient:
    """Sends ``AddRequest`` to engine cores and keeps every output and rejection it gets."""

    bus: Bus
    subjects: Subjects
    client_id: str = field(default_factory=lambda: f"bare-{uuid.uuid4().hex[:8]}")
    outputs: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)
    rejected: dict[str, RequestRejected] = field(default_factory=dict)

    async def start(self) -> BareClient:
        await self.bus.subscribe(self.subjects.engine_out(self.client_id), self._on_msg)
        await self.bus.flush()
        return self

    async def _on_msg(self, msg: Msg) -> None:
        match _OUTBOUND.decode(msg.data):
            case EngineOutputs(outputs=outputs):
                for output in outputs:
                    self.outputs.setdefault(output.request_id, []).append(output)
            case RequestRejected() as rejected:
                self.rejected[rejected.request_id] = rejected

    async def add(
        self, engine_id: str, request_id: str, prompt_ids: list[int], max_tokens: int
    ) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        add = AddRequest(request_id, prompt_ids, params, self.client_id, 0.0)
        await self.bus.publish(self.subjects.engine_in(engine_id), encode(add))

    def token_ids(self, request_id: str) -> list[int]:
        return [t for o in self.outputs.get(request_id, []) for t in o.new_token_ids]

    def final(self, request_id: str) -> EngineCoreOutput | None:
        outputs = self.outputs.get(request_id, [])
        return outputs[-1] if outputs and outputs[-1].finish_reason is not None else None
