"""The recovery controller runs wherever the deployment's plan runs, with fault tolerance on:
beside the engine core in the offline ``LLM`` (one process) and as its own supervised process
over NATS (local mode's path), watching the engine cores."""

from __future__ import annotations

import pytest

from shoal import LLM, SamplingParams
from shoal.bus import connect_bus
from shoal.bus.codec import Codec
from shoal.bus.messages.control import ActorState, Heartbeat
from shoal.bus.msg import Msg
from shoal.bus.subjects import Subjects
from shoal.deploy.deployment import build_config
from shoal.engine.recovery.actor import RecoveryControllerActor
from tests.integration.conditions import wait_for
from tests.integration.process_deployment import process_deployment

pytestmark = pytest.mark.timeout(180)


def test_the_offline_llm_runs_the_controller_with_fault_tolerance(tiny_checkpoint):  # type: ignore[no-untyped-def]
    model = str(tiny_checkpoint("llama"))
    with LLM(model, num_gpu_blocks_override=64, enable_fault_tolerance=True) as llm:
        (controller,) = [a for a in llm._actors if isinstance(a, RecoveryControllerActor)]
        assert controller.state is ActorState.READY
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate("hello", params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        engine = controller.policy.engines.get("engine-0")
        assert engine is not None and engine.state is ActorState.READY  # it watches
    with LLM(model, num_gpu_blocks_override=64, enable_fault_tolerance=False) as llm:
        assert not [a for a in llm._actors if isinstance(a, RecoveryControllerActor)]


@pytest.mark.nats
async def test_a_process_deployment_runs_the_controller_as_its_own_process(
    nats_url, tiny_checkpoint
):  # type: ignore[no-untyped-def]
    config = build_config(
        model=str(tiny_checkpoint("llama")),
        num_gpu_blocks_override=64,
        namespace="rcwiring",
        enable_fault_tolerance=True,
    )
    bus = await connect_bus(nats_url)
    beats: list[Heartbeat] = []
    codec: Codec[Heartbeat] = Codec(Heartbeat)

    async def on_beat(msg: Msg) -> None:
        beats.append(codec.decode(msg.data))

    await bus.subscribe(Subjects("rcwiring").heartbeat("recovery"), on_beat)
    try:
        async with process_deployment(nats_url, config) as deployment:
            assert deployment.supervisor.pid("recovery-0") is not None
            await wait_for(
                lambda: any(
                    b.actor_id == "recovery-0" and b.state is ActorState.READY for b in beats
                ),
                30,
                "recovery-0's heartbeats",
            )
            beat = next(b for b in beats if b.actor_id == "recovery-0")
            assert beat.load["num_retries_sent"] == 0.0
    finally:
        await bus.close()
