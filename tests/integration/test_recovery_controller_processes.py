"""The recovery controller in a deployment of processes over a real nats-server, with nobody
else sending commands: a fault injected into an engine core makes it UNHEALTHY, the controller's
retry brings it back READY (the same process: no restart) and it serves the same greedy tokens
as before the fault."""

from __future__ import annotations

import asyncio

import pytest

from shoal.bus.codec import Codec
from shoal.bus.messages.control import ActorState, ControlEvent, Heartbeat, StatusEvent
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.msg import Msg
from shoal.bus.subjects import Subjects
from shoal.deploy.deployment import build_config
from tests.integration.conditions import wait_for
from tests.integration.fault_tools import inject_engine_fault
from tests.integration.process_deployment import process_deployment

pytestmark = [pytest.mark.timeout(300), pytest.mark.nats, pytest.mark.slow]

NAMESPACE = "rcprocs"
PROMPT = [5, 17, 42, 7, 99, 3, 12, 8]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


class Watched:
    """Engine status events and the controller's heartbeats, as they arrive."""

    def __init__(self) -> None:
        self.engine_states: list[ActorState] = []
        self.controller: Heartbeat | None = None
        self._codec: Codec[ControlEvent] = Codec(ControlEvent)

    async def on_msg(self, msg: Msg) -> None:
        event = self._codec.decode(msg.data)
        if isinstance(event, StatusEvent) and event.actor_id == "engine-0":
            self.engine_states.append(event.state)
        elif isinstance(event, Heartbeat) and event.actor_id == "recovery-0":
            self.controller = event

    def num_retries_succeeded(self) -> float:
        return 0.0 if self.controller is None else self.controller.load["num_retries_succeeded"]


async def _generate(client, request_id: str):  # type: ignore[no-untyped-def]
    final = None
    async for output in client.generate(PROMPT, PARAMS, request_id):
        final = output
    assert final is not None
    return final.outputs[0]


async def test_an_injected_fault_is_recovered_by_the_controller(nats_server, tiny_checkpoint):  # type: ignore[no-untyped-def]
    config = build_config(
        model=str(tiny_checkpoint("llama")),
        num_gpu_blocks_override=96,
        max_num_seqs=8,
        namespace=NAMESPACE,
        enable_fault_tolerance=True,
        enable_request_resumption=False,  # the victim's clean error; no resumption here
        recovery_backoff_s=0.2,
    )
    subjects = Subjects(NAMESPACE)
    async with process_deployment(nats_server.url, config) as deployed:
        client, supervisor = deployed.client, deployed.supervisor
        watched = Watched()
        await client.bus.subscribe(subjects.status("engine"), watched.on_msg)
        await client.bus.subscribe(subjects.heartbeat("recovery"), watched.on_msg)
        await wait_for(lambda: watched.controller is not None, 30, "the controller's heartbeat")
        before = await _generate(client, "before")
        assert before.finish_reason == "length"
        await inject_engine_fault(client.bus, subjects, "engine-0")
        victim = await _generate(client, "victim")
        assert victim.finish_reason == "error"
        await wait_for(lambda: watched.num_retries_succeeded() >= 1, 60, "the controller's retry")
        await wait_for(lambda: client.is_ready(), 30, "engine-0 ready again")
        assert ActorState.UNHEALTHY in watched.engine_states
        faulted = watched.engine_states.index(ActorState.UNHEALTHY)
        assert ActorState.READY in watched.engine_states[faulted:]
        after = await _generate(client, "after")
        assert (after.finish_reason, after.token_ids) == ("length", before.token_ids)
        assert supervisor.num_restarts("engine-0") == 0  # recovered in place


async def test_dp2_fault_in_rank_1_is_recovered_while_rank_0_serves(nats_server, tiny_checkpoint):  # type: ignore[no-untyped-def]
    namespace = f"{NAMESPACE}dp"
    config = build_config(
        model=str(tiny_checkpoint("llama")),
        num_gpu_blocks_override=96,
        max_num_seqs=8,
        namespace=namespace,
        data_parallel_size=2,
        enable_fault_tolerance=True,
        recovery_backoff_s=0.2,
    )
    subjects = Subjects(namespace)
    async with process_deployment(nats_server.url, config) as deployed:
        client, supervisor = deployed.client, deployed.supervisor
        states: dict[str, list[ActorState]] = {"engine-0": [], "engine-1": []}
        reasons: list[str] = []  # engine-1's, while faulted
        codec: Codec[ControlEvent] = Codec(ControlEvent)

        async def on_status(msg: Msg) -> None:
            event = codec.decode(msg.data)
            if isinstance(event, StatusEvent) and event.actor_id in states:
                states[event.actor_id].append(event.state)
                if event.state is ActorState.UNHEALTHY:
                    reasons.append(event.reason)

        await client.bus.subscribe(subjects.status("engine"), on_status)
        before = await _generate(client, "before")
        await inject_engine_fault(client.bus, subjects, "engine-1")
        # Enough requests that some land on engine-1 (least loaded first): its next step faults.
        finals = await asyncio.gather(*(_generate(client, f"r{i}") for i in range(4)))
        await wait_for(lambda: ActorState.UNHEALTHY in states["engine-1"], 30, "engine-1 faulted")
        assert "injected fault" in reasons[0], reasons  # fault_info, published at once
        await wait_for(lambda: len(client.router.ready_engines()) == 2, 60, "both ready again")
        faulted = states["engine-1"].index(ActorState.UNHEALTHY)
        assert ActorState.READY in states["engine-1"][faulted:]
        assert states["engine-0"] == []  # rank 0 never left READY
        # Resumption is on: the requests cut by the fault completed elsewhere, unchanged.
        assert all((f.finish_reason, f.token_ids) == ("length", before.token_ids) for f in finals)
        assert (supervisor.num_restarts("engine-0"), supervisor.num_restarts("engine-1")) == (0, 0)
