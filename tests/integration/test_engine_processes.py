"""End to end with every actor in its own process over a real nats-server (the supervisor
runs them): greedy tokens equal transformers', both data-parallel engine cores take load, and
a worker killed mid-generation fails its in-flight requests cleanly, then serves again."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from shoal.bus import connect_bus
from shoal.bus.messages.config import ShoalConfig
from shoal.bus.supervisor import ActorSpec, Supervisor
from shoal.deploy.deployment import build_config, plan_actors
from shoal.engine.client.engine_client import AsyncEngineClient
from tests.fixtures.models import hf_greedy, make_prompts

pytestmark = [pytest.mark.timeout(300), pytest.mark.nats, pytest.mark.slow]


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


@pytest.fixture
async def deployment(nats_server, tiny_checkpoint):  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    config = build_config(
        model=str(model_dir),
        data_parallel_size=2,
        num_gpu_blocks_override=128,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        namespace="procs",
    )
    bus = await connect_bus(nats_server.url)
    supervisor = Supervisor(_specs(config, nats_server.url), status_bus=bus, namespace="procs")
    await supervisor.start()
    client = AsyncEngineClient(bus, config)
    await client.start()
    try:
        await client.wait_until_ready(120, num_engines=2)
        yield model_dir, client, supervisor
    finally:
        await client.close()
        await supervisor.stop()
        await bus.close()


async def test_processes_greedy_and_load_sharing(deployment):  # type: ignore[no-untyped-def]
    from shoal.bus.messages.sampling import SamplingParams

    model_dir, client, _ = deployment
    prompts = make_prompts()
    expected = hf_greedy(model_dir, prompts, 8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    finals = await asyncio.gather(
        *(_final(client, p, params, f"r{i}") for i, p in enumerate(prompts))
    )
    assert [f.outputs[0].token_ids for f in finals] == expected
    await asyncio.sleep(0.3)  # the last stats of both engine cores
    served = {
        v.engine_id: v.stats.stats.num_generation_tokens for v in client.router.engines.values()
    }
    assert set(served) == {"engine-0", "engine-1"}
    assert all(tokens > 0 for tokens in served.values()), served


async def test_processes_stream_and_abort(deployment):  # type: ignore[no-untyped-def]
    from shoal.bus.messages.sampling import OutputKind, SamplingParams

    _, client, _ = deployment
    whole = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = await _final(client, "hello there", whole, "whole")
    delta = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=OutputKind.DELTA
    )
    pieces = [o.outputs[0].text async for o in client.generate("hello there", delta, "delta")]
    assert "".join(pieces) == full.outputs[0].text
    # Abort mid-generation: the engine core frees the request and its blocks.
    endless = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    stream = client.generate([3, 4, 5], endless, "victim")
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(100):
        await asyncio.sleep(0.1)
        stats = [v.stats.stats for v in client.router.engines.values()]
        if all(s.num_running == 0 and s.kv_usage == 0.0 for s in stats):
            break
    assert all(s.num_running == 0 and s.num_waiting == 0 for s in stats), stats
    assert all(s.kv_usage == 0.0 for s in stats), stats


async def test_worker_killed_mid_generation(deployment):  # type: ignore[no-untyped-def]
    from shoal.bus.messages.sampling import SamplingParams

    _, client, supervisor = deployment
    long = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    tasks = [
        asyncio.create_task(_final(client, [5, 6, 7, 8 + i], long, f"long{i}")) for i in range(6)
    ]
    await asyncio.sleep(1.0)  # generation under way on both engine cores
    victim = "worker-0-0"
    pid = supervisor.pid(victim)
    assert pid is not None
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    done, pending = await asyncio.wait(tasks, timeout=30)
    assert not pending, "requests hung after the worker died"
    finals = [t.result() for t in done]
    reasons = {f.outputs[0].finish_reason for f in finals}
    assert "error" in reasons, reasons
    errored = [f for f in finals if f.outputs[0].finish_reason == "error"]
    assert all(f.error for f in errored)
    assert time.monotonic() - killed_at < 30
    # The supervisor restarts the worker; its engine core reconnects and serves again.
    await client.wait_until_ready(120, num_engines=2)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    results = await asyncio.wait_for(
        asyncio.gather(*(_final(client, [9, 9, i], short, f"after{i}") for i in range(4))), 120
    )
    assert all(r.outputs[0].finish_reason == "length" for r in results)
    assert supervisor.num_restarts(victim) >= 1


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
