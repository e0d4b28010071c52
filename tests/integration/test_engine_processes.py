"""End to end with every actor in its own process over a real nats-server (the supervisor
runs them), fault tolerance off: greedy tokens equal transformers', both data-parallel engine
cores take load, a worker killed mid-generation fails every request of its engine core cleanly
while the other engine core's finish, and an engine core killed under load (restarted under the
same id, its death unreported) fails its requests at once through its new incarnation; each
then serves again. One deployment serves the module's tests (each leaves it healthy)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field

import pytest
import pytest_asyncio

from shoal.bus import connect_bus
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.runtime.supervisor import ActorSpec, Supervisor
from shoal.config.deployment import ShoalConfig
from shoal.deploy.deployment import build_config, plan_actors
from shoal.engine.client.collector import RequestOutputCollector
from shoal.engine.client.engine_client import AsyncEngineClient
from shoal.engine.client.outputs import RequestOutput
from tests.fixtures.models import hf_greedy, make_prompts
from tests.integration.conditions import wait_for

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.nats,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
]

LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)  # context: 1024
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LIMIT_S = 120.0


async def _final(client, prompt, params, request_id):  # type: ignore[no-untyped-def]
    final = None
    async for output in client.generate(prompt, params, request_id):
        final = output
    return final


def _specs(config: ShoalConfig, url: str) -> list[ActorSpec]:
    fast = {"heartbeat_interval_s": 0.2}
    return [
        ActorSpec(p.name, p.target, url, {**p.kwargs, **fast}, kind=p.kind)
        for p in plan_actors(config)
    ]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment(nats_server, tiny_checkpoint):  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    config = build_config(
        model=str(model_dir),
        data_parallel_size=2,
        num_gpu_blocks_override=256,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        namespace="procs",
        enable_fault_tolerance=False,  # the clean failures without it (tests of it: *_fault_*)
    )
    bus = await connect_bus(nats_server.url)
    supervisor = Supervisor(_specs(config, nats_server.url), status_bus=bus, namespace="procs")
    await supervisor.start()
    client = AsyncEngineClient(bus, config)
    await client.start()
    try:
        await client.wait_until_ready(LIMIT_S, num_engines=2)
        yield model_dir, client, supervisor
    finally:
        await client.close()
        await supervisor.stop()
        await bus.close()


@dataclass
class Tracked:
    """A request read to its end in a task; ``num_outputs`` counts what arrived so far."""

    collector: RequestOutputCollector
    engine_id: str
    num_outputs: int = 0
    task: asyncio.Task[RequestOutput] = field(init=False)

    def __post_init__(self) -> None:
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> RequestOutput:
        while True:
            output = await self.collector.get()
            self.num_outputs += 1
            if output.finished:
                return output


async def _send_long(client: AsyncEngineClient, n: int) -> dict[str, Tracked]:
    """``n`` long requests, spread by the router; returns once every one is generating."""
    tracked = {}
    for i in range(n):
        request_id = f"long{i}-{time.monotonic_ns()}"
        collector = await client.add_request([5, 6, 7, 8 + i], LONG, request_id)
        tracked[request_id] = Tracked(collector, client.placements.placed()[request_id])
    await wait_for(lambda: all(t.num_outputs > 0 for t in tracked.values()), LIMIT_S, "outputs")
    return tracked


async def _serves_on(client: AsyncEngineClient, engine_id: str) -> None:
    """Short requests, spread by the router over both engine cores, all finish; one of them
    ran on ``engine_id``."""
    await client.wait_until_ready(LIMIT_S, num_engines=2)
    collectors = {}
    for i in range(4):
        request_id = f"after{i}-{time.monotonic_ns()}"
        collectors[request_id] = await client.add_request([9, 9, i], SHORT, request_id)
    trackers = [Tracked(c, client.placements.placed()[r]) for r, c in collectors.items()]
    engines = {t.engine_id for t in trackers}
    finals = await asyncio.wait_for(asyncio.gather(*(t.task for t in trackers)), LIMIT_S)
    assert engine_id in engines, engines
    assert all(f.outputs[0].finish_reason == "length" for f in finals), finals


def _split(tracked: dict[str, Tracked], victim: str) -> tuple[list[Tracked], list[Tracked]]:
    on_victim = [t for t in tracked.values() if t.engine_id == victim]
    others = [t for t in tracked.values() if t.engine_id != victim]
    assert on_victim and others, {r: t.engine_id for r, t in tracked.items()}
    assert not any(t.task.done() for t in tracked.values())  # all in flight at the kill
    return on_victim, others


async def _outcomes(on_victim: list[Tracked], others: list[Tracked], error: str = "") -> None:
    """Every request of the victim ends with a clean error (saying ``error``) promptly; the
    others finish normally."""
    finals = await asyncio.wait_for(asyncio.gather(*(t.task for t in on_victim)), 60)
    for final in finals:
        assert final.outputs[0].finish_reason == "error", final
        assert final.error and error in final.error, final.error
    finals = await asyncio.wait_for(asyncio.gather(*(t.task for t in others)), LIMIT_S)
    for final in finals:
        assert final.outputs[0].finish_reason == "length", final
        assert len(final.outputs[0].token_ids) == LONG.max_tokens


async def test_processes_greedy_and_load_sharing(deployment):  # type: ignore[no-untyped-def]
    model_dir, client, _ = deployment

    def served() -> dict[str, int]:
        views = client.router.engines.values()
        return {v.engine_id: v.stats.stats.num_generation_tokens for v in views}

    before = served()
    prompts = make_prompts()
    expected = hf_greedy(model_dir, prompts, 8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    finals = await asyncio.gather(
        *(_final(client, p, params, f"r{i}") for i, p in enumerate(prompts))
    )
    assert [f.outputs[0].token_ids for f in finals] == expected
    # Both engine cores report generated tokens (their stats follow their steps).
    both = ("engine-0", "engine-1")
    await wait_for(lambda: all(served()[e] > before.get(e, 0) for e in both), 30, "stats")
    assert set(served()) == {"engine-0", "engine-1"}


async def test_processes_stream(deployment):  # type: ignore[no-untyped-def]
    from shoal.bus.messages.sampling import OutputKind

    _, client, _ = deployment
    whole = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = await _final(client, "hello there", whole, "whole")
    delta = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=OutputKind.DELTA
    )
    pieces = [o.outputs[0].text async for o in client.generate("hello there", delta, "delta")]
    assert "".join(pieces) == full.outputs[0].text


async def test_worker_killed_mid_generation(deployment):  # type: ignore[no-untyped-def]
    _, client, supervisor = deployment
    tracked = await _send_long(client, 6)
    victim = next(iter(tracked.values())).engine_id  # "engine-d"; its worker is worker-d-0
    worker = f"worker-{victim.rsplit('-', 1)[1]}-0"
    restarts = supervisor.num_restarts(worker)
    pid = supervisor.pid(worker)
    assert pid is not None
    on_victim, others = _split(tracked, victim)
    os.kill(pid, signal.SIGKILL)
    await _outcomes(on_victim, others)
    # The supervisor restarts the worker; its engine core reconnects and serves again.
    await wait_for(lambda: supervisor.num_restarts(worker) > restarts, LIMIT_S, "restart")
    await _serves_on(client, victim)


async def test_engine_core_killed_under_load_fails_its_requests_at_once(deployment):  # type: ignore[no-untyped-def]
    """Restarted under the same id within seconds, with no DEAD status published (as when a
    supervisor elsewhere restarts it): only its new incarnation tells the client."""
    _, client, supervisor = deployment
    tracked = await _send_long(client, 6)
    victim = next(iter(tracked.values())).engine_id
    epoch, restarts = client.router.epoch(victim), supervisor.num_restarts(victim)
    pid = supervisor.pid(victim)
    assert pid is not None
    on_victim, others = _split(tracked, victim)
    status_bus, supervisor.status_bus = supervisor.status_bus, None
    try:
        os.kill(pid, signal.SIGKILL)
        await _outcomes(on_victim, others, "restarted")
    finally:
        supervisor.status_bus = status_bus
    assert supervisor.num_restarts(victim) == restarts + 1
    assert client.router.epoch(victim) == epoch + 1
    placed = client.placements.placed()
    assert not placed, placed  # nothing left behind in the client
    await _serves_on(client, victim)


async def test_tensor_parallel_workers_through_the_actor_path(nats_server, tiny_checkpoint):  # type: ignore[no-untyped-def]
    """TP=2: two worker processes share each layer (gloo) behind one engine core."""
    from shoal.bus.messages.sampling import SamplingParams
    from shoal.deploy.local import free_tcp_port

    model_dir = tiny_checkpoint("llama")
    config = build_config(
        model=str(model_dir),
        tensor_parallel_size=2,
        num_gpu_blocks_override=64,
        namespace="tp",
    )
    url = nats_server.url
    plans = plan_actors(config, tp_init_methods=[f"tcp://127.0.0.1:{free_tcp_port()}"])
    specs = [ActorSpec(p.name, p.target, url, p.kwargs, kind=p.kind) for p in plans]
    bus = await connect_bus(url)
    supervisor = Supervisor(specs, status_bus=bus, namespace="tp")
    await supervisor.start()
    client = AsyncEngineClient(bus, config)
    await client.start()
    try:
        await client.wait_until_ready(180)
        prompts = make_prompts()[:4]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        finals = await asyncio.gather(
            *(_final(client, p, params, f"tp{i}") for i, p in enumerate(prompts))
        )
        assert [f.outputs[0].token_ids for f in finals] == hf_greedy(model_dir, prompts, 6)
    finally:
        await client.close()
        await supervisor.stop()
        await bus.close()
