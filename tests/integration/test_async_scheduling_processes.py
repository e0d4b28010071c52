"""Async scheduling with every actor in its own process over a real nats-server (the supervisor
runs them): the workload of ``async_workload`` gives the same outputs as with async off in one
process, and the engine core's published stats show two steps in flight."""

from __future__ import annotations

import pytest
import pytest_asyncio

from shoal.deploy.deployment import build_config
from tests.integration.async_workload import run_all, run_in_one_process, settled_stats
from tests.integration.process_deployment import process_deployment

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.nats,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
]
NAMESPACE = "asyncprocs"
OPTIONS = {"num_gpu_blocks_override": 256, "max_num_seqs": 32, "max_num_batched_tokens": 64}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment(nats_server, tiny_checkpoint):  # type: ignore[no-untyped-def]
    config = build_config(
        model=str(tiny_checkpoint("llama")), namespace=NAMESPACE, async_scheduling=True, **OPTIONS
    )
    async with process_deployment(nats_server.url, config) as deployed:
        yield deployed.client, deployed.published


async def test_outputs_equal_async_off_in_one_process(deployment, tiny_checkpoint):  # type: ignore[no-untyped-def]
    client, published = deployment
    want = await run_in_one_process(tiny_checkpoint("llama"), OPTIONS, run_all)
    got = await run_all(client)
    assert got == want
    stats = await settled_stats(published)
    assert stats.max_steps_in_flight == 2
    assert stats.num_finished_error == 0 and stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == OPTIONS["num_gpu_blocks_override"] - 1
