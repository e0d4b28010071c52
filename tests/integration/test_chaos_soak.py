"""Chaos soak (bounded): 200 greedy requests through two engine cores in processes over NATS
while faults are injected into engine cores and workers, and workers, engine cores and the
recovery controller are SIGKILLed at random. With request resumption on, every request
completes with the tokens of a calm run; with it off, every request completes or ends with a
clean error; none hangs; afterwards every engine core is healthy again."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

from shoal.bus.codec import Codec
from shoal.bus.messages.control import ActorState
from shoal.bus.messages.fault import FaultInjected, InjectFault
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import WorkerOutbound
from shoal.bus.runtime.actor import call
from shoal.bus.subjects import Subjects
from shoal.deploy.deployment import build_config
from shoal.engine.client.interface import EngineUnavailableError
from tests.integration.conditions import wait_for
from tests.integration.fault_tools import inject_engine_fault
from tests.integration.process_deployment import process_deployment

pytestmark = [pytest.mark.timeout(420), pytest.mark.nats, pytest.mark.slow]

NUM_REQUESTS = 200
CONCURRENCY = 16
MAX_TOKENS = 24
FAULT_EVERY = 16  # ended requests between two faults: 11 faults over the workload
MAX_KILLS_PER_PROCESS = 2  # the supervisor gives up on a child after 5 deaths a minute
ENGINES = ("engine-0", "engine-1")
WORKERS = ("worker-0-0", "worker-1-0")
_WORKER_REPLY: Codec[WorkerOutbound] = Codec(WorkerOutbound)


def _config(model_dir, namespace: str, resume: bool):  # type: ignore[no-untyped-def]
    return build_config(
        model=str(model_dir),
        num_gpu_blocks_override=128,
        max_num_seqs=CONCURRENCY,
        max_num_batched_tokens=256,
        data_parallel_size=2,
        namespace=namespace,
        worker_dead_after_s=2.0,
        fault_tolerance_config={
            "enable_request_resumption": resume,
            "max_request_resumptions": 20,
            "request_resume_timeout_s": 60.0,
            "recovery_backoff_s": 0.2,
            "recovery_max_retries": 50,
        },
    )


def _prompt(i: int) -> list[int]:
    return [3 + (i * 37 + j * 11) % 250 for j in range(6 + i % 5)]


class Progress:
    """Requests of the current workload that have ended; the storm paces itself on it."""

    def __init__(self) -> None:
        self.num_ended = 0


async def _run(client, i: int, semaphore: asyncio.Semaphore, tag: str, progress: Progress):  # type: ignore[no-untyped-def]
    """(finish reason, tokens), or ("refused", message); bounded: never hangs."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async with semaphore:
        final = None
        try:
            async with asyncio.timeout(120):
                async for output in client.generate(_prompt(i), params, f"{tag}-{i}"):
                    final = output
        except EngineUnavailableError as exc:
            return "refused", str(exc)
        finally:
            progress.num_ended += 1
    assert final is not None and final.finished
    done = final.outputs[0]
    return done.finish_reason, list(done.token_ids)


async def _workload(client, tag: str, progress: Progress | None = None):  # type: ignore[no-untyped-def]
    semaphore, progress = asyncio.Semaphore(CONCURRENCY), progress or Progress()
    runs = (_run(client, i, semaphore, tag, progress) for i in range(NUM_REQUESTS))
    return await asyncio.gather(*runs)


async def _chaos(deployed, subjects: Subjects, progress: Progress, seed: int) -> list[str]:  # type: ignore[no-untyped-def]
    """A random fault each time another ``FAULT_EVERY`` requests have ended (so the storm
    spans the workload however fast the machine is), and none after the last requests
    started; what was done, in order."""
    rng, bus, supervisor = random.Random(seed), deployed.client.bus, deployed.supervisor
    actions: list[str] = []
    kills: dict[str, int] = {}
    for threshold in range(FAULT_EVERY, NUM_REQUESTS - CONCURRENCY, FAULT_EVERY):
        while progress.num_ended < threshold:
            await asyncio.sleep(0.01)
        kind = rng.choice(
            ["inject_engine", "inject_worker", "kill_worker", "kill_engine", "kill_controller"]
        )
        try:
            if kind == "inject_engine":
                target = rng.choice(ENGINES)
                await inject_engine_fault(bus, subjects, target)
            elif kind == "inject_worker":
                target = rng.choice(WORKERS)
                reply = await call(
                    bus, subjects.worker_in(target), InjectFault(), _WORKER_REPLY, timeout=5
                )
                assert isinstance(reply, FaultInjected)
            else:
                target = {"kill_worker": rng.choice(WORKERS), "kill_engine": rng.choice(ENGINES),
                          "kill_controller": "recovery-0"}[kind]  # fmt: skip
                pid = supervisor.pid(target)
                if pid is None or kills.get(target, 0) >= MAX_KILLS_PER_PROCESS:
                    kind, target = "inject_engine", rng.choice(ENGINES)  # spare the process
                    await inject_engine_fault(bus, subjects, target)
                else:
                    kills[target] = kills.get(target, 0) + 1
                    os.kill(pid, signal.SIGKILL)
        except Exception as exc:  # a target still restarting may not answer: chaos goes on
            actions.append(f"{kind} {exc!r}")
            continue
        actions.append(f"{kind} {target}")
    return actions


def _all_healthy(client) -> bool:  # type: ignore[no-untyped-def]
    peers = [client.router.liveness.get(e) for e in ENGINES]
    return all(p is not None and p.state is ActorState.READY for p in peers) and len(
        client.router.ready_engines()
    ) == len(ENGINES)


@pytest.mark.parametrize("resume", [True, False], ids=["resume", "no-resume"])
async def test_chaos_soak(nats_server, tiny_checkpoint, resume: bool):  # type: ignore[no-untyped-def]
    namespace = f"chaos{'r' if resume else 'n'}"
    config = _config(tiny_checkpoint("llama"), namespace, resume)
    async with process_deployment(nats_server.url, config) as deployed:
        client = deployed.client
        calm = await _workload(client, "calm")
        assert all(reason == "length" for reason, _ in calm)
        progress = Progress()
        chaos = asyncio.create_task(_chaos(deployed, Subjects(namespace), progress, seed=13))
        try:
            stormy = await _workload(client, "storm", progress)
        except BaseException:
            chaos.cancel()
            raise
        actions = await asyncio.wait_for(chaos, 30)
        assert len(actions) >= 10, actions  # the storm really happened
        await wait_for(lambda: _all_healthy(client), 90, "every engine core healthy again")
    if resume:
        lost = [i for i, (got, want) in enumerate(zip(stormy, calm, strict=True)) if got != want]
        assert not lost, (lost[:5], [stormy[i] for i in lost[:3]], actions)
    else:
        for (reason, tokens), (_, want) in zip(stormy, calm, strict=True):
            assert reason in ("length", "error", "refused"), reason
            if reason == "length":
                assert tokens == want
        assert any(reason == "length" for reason, _ in stormy)
