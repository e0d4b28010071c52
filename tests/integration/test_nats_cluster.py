"""A deployment spread over a three-node NATS cluster (``nats_cluster``): the engine client on
node 0, the engine core's process on node 1, its worker's on node 2 (each given only its own
node's URL), so every request's messages cross nodes; greedy tokens equal transformers'. Node 1
killed under a bounded load: every request in flight ends (finished, or a clean error) within a
bound, the engine core reconnects to a surviving node by itself (it was never given their URLs:
the cluster advertised them), and new requests are served with the same tokens; with fault
tolerance on, the cut requests resume and end with transformers' tokens."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from shoal.bus import connect_bus
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.nats_ops.cluster import NatsCluster
from shoal.bus.runtime.supervisor import ActorSpec, Supervisor
from shoal.deploy.deployment import build_config, plan_actors
from shoal.engine.client.engine_client import AsyncEngineClient
from shoal.engine.client.outputs import RequestOutput
from tests.fixtures.models import make_prompts
from tests.integration.conditions import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.nats, pytest.mark.slow]

NAMESPACE = "cluster"
NODE_OF = {"worker": 2, "engine": 1}  # the client (and a recovery controller) on node 0
LIMIT_S = 120.0
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@dataclass
class Spread:
    cluster: NatsCluster
    client: AsyncEngineClient
    supervisor: Supervisor
    model_dir: Path


@pytest_asyncio.fixture
async def spread(nats_cluster: NatsCluster, tiny_checkpoint, request) -> AsyncIterator[Spread]:  # type: ignore[no-untyped-def]
    """The deployment; ``request.param`` (indirect parametrisation) adds config options."""
    model_dir = tiny_checkpoint("llama")
    config = build_config(
        model=str(model_dir),
        num_gpu_blocks_override=128,
        max_num_seqs=8,
        namespace=NAMESPACE,
        jetstream_replicas=3,
        **getattr(request, "param", {}),
    )
    fast = {"heartbeat_interval_s": 0.2}
    specs = [
        ActorSpec(
            p.name,
            p.target,
            nats_cluster.urls[NODE_OF.get(p.kind, 0)],
            {**p.kwargs, **fast},
            bus_options={"name": p.name},  # the connection's name, as /connz lists it
            kind=p.kind,
        )
        for p in plan_actors(config)
    ]
    bus = await connect_bus(nats_cluster.urls[0])
    supervisor = Supervisor(specs, status_bus=bus, namespace=NAMESPACE)
    await supervisor.start()
    client = AsyncEngineClient(bus, config)
    await client.start()
    try:
        await client.wait_until_ready(LIMIT_S, num_engines=1)
        yield Spread(nats_cluster, client, supervisor, model_dir)
    finally:
        await client.close()
        await supervisor.stop()
        await bus.close()


def connections(cluster: NatsCluster) -> dict[str, int]:
    """Named client connection → the index of the node it is on (running nodes only)."""
    found = {}
    for i in cluster.running():
        port = cluster.nodes[i].monitor_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/connz", timeout=2) as reply:
            for conn in json.loads(reply.read()).get("connections") or []:
                if conn.get("name"):
                    found[conn["name"]] = i
    return found


async def _generate(client: AsyncEngineClient, prompt: list[int], request_id: str) -> RequestOutput:
    final = None
    async for output in client.generate(prompt, GREEDY, request_id):
        final = output
    assert final is not None
    return final


async def _serves_greedy(spread: Spread, hf_reference, tag: str) -> None:  # type: ignore[no-untyped-def]
    prompts = make_prompts()[:3]
    expected = hf_reference(spread.model_dir, prompts, MAX_TOKENS)
    finals = await asyncio.wait_for(
        asyncio.gather(
            *(
                _generate(spread.client, p, f"{tag}{i}-{time.monotonic_ns()}")
                for i, p in enumerate(prompts)
            )
        ),
        LIMIT_S,
    )
    assert [f.outputs[0].token_ids for f in finals] == expected


async def test_requests_cross_nodes_with_greedy_tokens(spread: Spread, hf_reference) -> None:  # type: ignore[no-untyped-def]
    on = connections(spread.cluster)
    assert on["engine-0"] == 1 and on["worker-0-0"] == 2, on
    await _serves_greedy(spread, hf_reference, "cross")


def _start_load(
    client: AsyncEngineClient, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[asyncio.Task[RequestOutput]], list[int]]:
    """A task per prompt generating to its end, and each one's count of outputs so far."""
    started = [0] * len(prompts)

    async def run(i: int, prompt: list[int]) -> RequestOutput:
        final = None
        async for output in client.generate(prompt, params, f"load{i}-{time.monotonic_ns()}"):
            started[i] += 1
            final = output
        assert final is not None
        return final

    return [asyncio.create_task(run(i, p)) for i, p in enumerate(prompts)], started


async def _kill_the_engines_node(
    spread: Spread, prompts: list[list[int]], params: SamplingParams
) -> list[RequestOutput]:
    """Requests generating, then node 1 (the engine core's) killed: their final outputs."""
    tasks, started = _start_load(spread.client, prompts, params)
    await wait_for(lambda: all(started), LIMIT_S, "every request generating")
    spread.cluster.kill_node(1)
    return await asyncio.wait_for(asyncio.gather(*tasks), LIMIT_S)


async def _engine_moved(spread: Spread) -> None:
    await wait_for(
        lambda: connections(spread.cluster).get("engine-0") in (0, 2), LIMIT_S, "engine moved"
    )
    assert spread.supervisor.num_restarts("engine-0") == 0  # it reconnected, not restarted


async def test_a_node_killed_under_load(spread: Spread, hf_reference) -> None:  # type: ignore[no-untyped-def]
    """The engine core's node dies while requests run: each ends within a bound, finished with
    all its tokens or with a clean error; the engine core moves to another node; new requests
    get transformers' tokens."""
    prompts = make_prompts(lengths=[5, 7, 9, 11, 13, 15], seed=3)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for final in await _kill_the_engines_node(spread, prompts, long):
        out = final.outputs[0]
        assert out.finish_reason in ("length", "error"), final
        if out.finish_reason == "length":
            assert len(out.token_ids) == long.max_tokens
        else:
            assert final.error, final
    await _engine_moved(spread)
    await spread.client.wait_until_ready(LIMIT_S, num_engines=1)
    await _serves_greedy(spread, hf_reference, "after")


@pytest.mark.parametrize("spread", [{"enable_fault_tolerance": True}], indirect=True)
async def test_with_resumption_a_node_killed_under_load_loses_no_request(  # type: ignore[no-untyped-def]
    spread: Spread, hf_reference
) -> None:
    """Fault tolerance on (request resumption): the requests cut when the engine core's node
    dies resume where their streams left off, and every one ends with transformers' tokens."""
    prompts = make_prompts(lengths=[5, 7, 9, 11, 13, 15], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    want = hf_reference(spread.model_dir, prompts, params.max_tokens)
    finals = await _kill_the_engines_node(spread, prompts, params)
    assert [f.outputs[0].finish_reason for f in finals] == ["length"] * len(prompts), finals
    assert [list(f.outputs[0].token_ids) for f in finals] == want
    await _engine_moved(spread)
