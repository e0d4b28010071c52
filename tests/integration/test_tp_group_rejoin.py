"""TP=2 with fault tolerance on, over a real nats-server, each worker in its own supervised
process; the test stands for the engine core with its ``WorkerLink``. The workers join the group
of epoch e1 at the handshake and generate transformers' greedy tokens. Then one worker is
SIGKILLed and restarted by the supervisor: at the next handshake (epoch e2) the survivor drops
its broken group and both join a new one on a new port, and the tokens are the same. Once more
with the other rank killed (e3: the survivor is rank 1, the new host a fresh rank 0)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from shoal.bus import connect_bus
from shoal.bus.messages.worker import ExecuteStep, StepResult
from shoal.bus.subjects import Subjects
from shoal.bus.supervisor import ActorSpec, ChildState, Supervisor
from shoal.deploy.deployment import build_config, plan_actors
from shoal.deploy.local import free_tcp_port
from shoal.engine.actor.worker_link import WorkerLink
from tests.fixtures.models import make_prompts
from tests.golden.driver import generate_by_hand

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
