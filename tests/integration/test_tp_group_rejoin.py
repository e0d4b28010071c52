"""TP=2 with fault tolerance on, over a real nats-server, each worker in its own supervised
process; the test stands for the engine core with its ``WorkerLink``. The workers join the group
of epoch e1 at the handshake and generate transformers' greedy tokens. Then one worker is
SIGKILLed and restarted by the supervisor: at the next handshake (epoch e2) the survivor drops
its broken group and both join a new one on a new port, and the tokens are the same. Once more
with the other rank killed (e3: the survivor is rank 1, the new host a fresh rank 0). And the
whole path through a real engine core and the recovery controller."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from shoal.bus import connect_bus
from shoal.bus.codec import Codec
from shoal.bus.messages.control import ActorState, ControlEvent, StatusEvent
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import ExecuteStep, StepResult
from shoal.bus.msg import Msg
from shoal.bus.runtime.supervisor import ActorSpec, ChildState, Supervisor
from shoal.bus.subjects import Subjects
from shoal.deploy.deployment import build_config, plan_actors
from shoal.deploy.local import free_tcp_port
from shoal.engine.actor.worker_link import WorkerLink
from tests.fixtures.models import make_prompts
from tests.golden.driver import generate_by_hand
from tests.integration.conditions import wait_for
from tests.integration.process_deployment import process_deployment

pytestmark = [pytest.mark.timeout(420), pytest.mark.nats, pytest.mark.slow]

BLOCK = 4
MAX_NEW = 6
LOAD_S = 180.0
NAMESPACE = "tprejoin"
WORKERS = ["worker-0-0", "worker-0-1"]


class LinkRunner:
    """``generate_by_hand``'s runner, played by the link from a helper thread."""

    def __init__(self, link: WorkerLink, loop: asyncio.AbstractEventLoop) -> None:
        self.link = link
        self.loop = loop

    def execute(self, step: ExecuteStep) -> StepResult:
        result = asyncio.run_coroutine_threadsafe(self.link.execute(step), self.loop).result(120)
        assert result.error is None, result.error
        return result


async def _generate(link: WorkerLink, prompts: list[list[int]]) -> list[list[int]]:
    runner = LinkRunner(link, asyncio.get_running_loop())
    return await asyncio.to_thread(generate_by_hand, runner, prompts, MAX_NEW, BLOCK)  # type: ignore[arg-type]


async def _kill_and_wait_restart(supervisor: Supervisor, name: str) -> None:
    pid = supervisor.pid(name)
    assert pid is not None
    restarts = supervisor.num_restarts(name)
    os.kill(pid, signal.SIGKILL)
    await supervisor.wait_for(name, ChildState.RUNNING, timeout=60, min_restarts=restarts + 1)


async def _rejoin(link: WorkerLink, epoch: str) -> str:
    await link.handshake(LOAD_S, group_epoch=epoch)
    addresses = set(link.group_init_methods.values())
    assert len(link.group_init_methods) == 2 and len(addresses) == 1, link.group_init_methods
    return addresses.pop()


async def test_a_restarted_rank_and_its_survivor_join_a_new_group(
    nats_server, tiny_checkpoint, hf_reference: object
) -> None:  # type: ignore[no-untyped-def]
    model_dir: Path = tiny_checkpoint("llama")
    config = build_config(
        model=str(model_dir),
        tensor_parallel_size=2,
        num_gpu_blocks_override=64,
        block_size=BLOCK,
        namespace=NAMESPACE,
        fault_tolerance_config={},
    )
    static = f"tcp://127.0.0.1:{free_tcp_port()}"
    plans = [p for p in plan_actors(config, tp_init_methods=[static]) if p.kind == "worker"]
    fast = {"heartbeat_interval_s": 0.2}
    specs = [
        ActorSpec(p.name, p.target, nats_server.url, {**p.kwargs, **fast}, kind=p.kind)
        for p in plans
    ]
    bus = await connect_bus(nats_server.url)
    supervisor = Supervisor(specs, status_bus=bus, namespace=NAMESPACE)
    link = WorkerLink(bus, Subjects(NAMESPACE), "engine-0", WORKERS)
    prompts = make_prompts()[:3]
    expected = hf_reference(model_dir, prompts, MAX_NEW)  # type: ignore[operator]
    await supervisor.start()
    await link.start()
    try:
        first = await _rejoin(link, "e1")
        assert first.startswith("tcp://127.0.0.1:") and first != static
        assert await _generate(link, prompts) == expected

        await _kill_and_wait_restart(supervisor, WORKERS[1])  # the survivor hosts the next group
        second = await _rejoin(link, "e2")
        assert second != first
        assert await _generate(link, prompts) == expected

        await _kill_and_wait_restart(supervisor, WORKERS[0])  # a fresh rank 0 hosts it
        third = await _rejoin(link, "e3")
        assert third not in (first, second)
        assert await _generate(link, prompts) == expected
    finally:
        await link.stop()
        await supervisor.stop()
        await bus.close()


class EngineStates:
    """engine-0's states, as its status events announce them."""

    def __init__(self) -> None:
        self.states: list[ActorState] = []
        self._codec: Codec[ControlEvent] = Codec(ControlEvent)

    async def on_msg(self, msg: Msg) -> None:
        event = self._codec.decode(msg.data)
        if isinstance(event, StatusEvent) and event.actor_id == "engine-0":
            self.states.append(event.state)

    def recovered(self) -> bool:
        faulted = [i for i, s in enumerate(self.states) if s is not ActorState.READY]
        return bool(faulted) and ActorState.READY in self.states[faulted[0] :]


async def test_tp2_behind_one_engine_core_recovers_from_a_killed_worker_with_a_new_group(
    nats_server, tiny_checkpoint, hf_reference: object
) -> None:  # type: ignore[no-untyped-def]
    """The whole path: the engine core handshakes with a group epoch; a rank SIGKILLed while
    a request runs (its survivor's collective breaks) makes the engine core DEAD; the supervisor
    restarts the rank; the recovery controller's retry re-handshakes (a new epoch, a new group)
    and the outputs still equal transformers'."""
    model_dir: Path = tiny_checkpoint("llama")
    namespace = f"{NAMESPACE}e2e"
    config = build_config(
        model=str(model_dir),
        tensor_parallel_size=2,
        num_gpu_blocks_override=64,
        namespace=namespace,
        enable_fault_tolerance=True,
        enable_request_resumption=False,
        recovery_backoff_s=0.2,
    )
    prompts = make_prompts()[:3]
    expected = hf_reference(model_dir, prompts, MAX_NEW)  # type: ignore[operator]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

    async def generate(tag: str) -> list[list[int]]:
        async def one(i: int, prompt: list[int]) -> list[int]:
            final = None
            async for output in deployed.client.generate(prompt, params, f"{tag}{i}"):
                final = output
            assert final is not None and final.outputs[0].finish_reason == "length", final
            return list(final.outputs[0].token_ids)

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    async with process_deployment(nats_server.url, config) as deployed:
        watched = EngineStates()
        await deployed.client.bus.subscribe(Subjects(namespace).status("engine"), watched.on_msg)
        assert await generate("before") == expected
        outputs: list[object] = []  # a long request, running when its rank is killed

        async def long_request() -> str | None:
            long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
            async for output in deployed.client.generate(prompts[0], long, "long"):
                outputs.append(output)
            return output.outputs[0].finish_reason

        running = asyncio.create_task(long_request())
        await wait_for(lambda: len(outputs) >= 3, 60, "the long request running")
        await _kill_and_wait_restart(deployed.supervisor, WORKERS[1])
        assert await asyncio.wait_for(running, 60) == "error"  # resumption is off here
        await wait_for(watched.recovered, 120, "engine-0 faulted, then READY again")
        await wait_for(deployed.client.is_ready, 30, "the client sees engine-0 ready")
        assert ActorState.DEAD in watched.states
        assert await generate("after") == expected
        assert deployed.supervisor.num_restarts("engine-0") == 0  # recovered in place
