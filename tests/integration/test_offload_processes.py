"""KV offload with every actor in its own process over a real nats-server (the supervisor runs
them; the CPU and filesystem tiers too): returning conversations load from the tiers with the
same tokens as offload off, and a CPU tier SIGKILLed while lookups wait on it costs only
recomputes (every request completes, correctly); restarted, it serves loads again."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from shoal.bus.runtime.supervisor import ChildState
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.config.deployment import ShoalConfig
from tests.integration.async_workload import complete, greedy
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import engine_stack
from tests.integration.offload_workload import (
    BLOCK_SIZE,
    MAX_TOKENS,
    NUM_BLOCKS,
    conversations,
    first_turns,
    follow_up,
    offload_options,
)
from tests.integration.process_deployment import process_deployment

pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio]

ENGINE = {"num_gpu_blocks_override": NUM_BLOCKS, "block_size": BLOCK_SIZE, "dtype": "float32"}
CPU_TIER = "kv-cpu"


def make_config(
    model_dir: Path,
    namespace: str,
    tmp_path: Path,
    extra: dict[str, Any] | None = None,
    **more: Any,
) -> ShoalConfig:
    """The offload deployment: ``extra`` more offload keys, ``more`` more engine options."""
    return ShoalConfig.from_options(
        model=str(model_dir),
        namespace=namespace,
        max_num_batched_tokens=256,
        **ENGINE,
        **offload_options(tmp_path, **(extra or {})),
        **more,
    )


async def reference(model_dir: Path) -> list[list[int]]:
    """Offload off, in this process."""
    bus = InMemoryBus(InMemoryBroker())
    await bus.connect()
    try:
        async with engine_stack(
            bus, model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=256
        ) as built:
            return await conversations(built.client)
    finally:
        await bus.close()


async def test_tiers_in_their_own_processes(nats_url, tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    want = await reference(model_dir)
    config = make_config(model_dir, "offload-procs", tmp_path)
    async with process_deployment(nats_url, config) as deployment:
        assert await conversations(deployment.client) == want
        published = deployment.published
        await wait_for(
            lambda: published.stats.kv_offload_hits >= 4 * 8 * BLOCK_SIZE, 30, "the loads counted"
        )
        assert published.stats.kv_offload_load_bytes > 0
    assert list(tmp_path.rglob("*.bin")), "the chunks cascaded to the filesystem tier"


async def test_two_tensor_parallel_ranks_each_copy_their_slice(
    nats_url, tiny_checkpoint, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """TP=2: each worker process copies its half of the KV heads into its part of every slot;
    the returning conversations load both halves and decode the offload-off tokens."""
    from shoal.deploy.local import free_tcp_port

    model_dir = tiny_checkpoint("llama")
    want = await reference(model_dir)
    config = make_config(model_dir, "offload-tp", tmp_path, tensor_parallel_size=2)
    init = [f"tcp://127.0.0.1:{free_tcp_port()}"]
    async with process_deployment(nats_url, config, tp_init_methods=init) as deployment:
        assert await conversations(deployment.client) == want
        published = deployment.published
        await wait_for(
            lambda: published.stats.kv_offload_hits >= 4 * 8 * BLOCK_SIZE, 30, "the loads counted"
        )


async def test_a_cpu_tier_killed_while_lookups_wait_costs_only_recomputes(
    nats_url, tiny_checkpoint, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    want = await reference(model_dir)
    config = make_config(model_dir, "offload-kill", tmp_path, {"kv_lookup_timeout_s": 1.0})
    async with process_deployment(nats_url, config) as deployment:
        client, published, supervisor = (
            deployment.client,
            deployment.published,
            deployment.supervisor,
        )
        answers = await first_turns(client)
        queries = published.stats.kv_offload_queries
        pid = supervisor.pid(CPU_TIER)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # wedged: the engine core's lookups wait on it
        returning = [
            asyncio.create_task(
                complete(client, follow_up(i, answer), greedy(MAX_TOKENS), f"t2-{i}")
            )
            for i, answer in enumerate(answers)
        ]
        await wait_for(lambda: published.stats.kv_offload_queries > queries, 30, "a lookup sent")
        os.kill(pid, signal.SIGKILL)
        finals = await asyncio.gather(*returning)
        assert answers + [list(f.outputs[0].token_ids) for f in finals] == want
        await wait_for(lambda: published.stats.kv_offload_lookup_failures >= 1, 30, "counted")

        # The supervisor restarts the tier; the engine core attaches to its new region and a
        # returning conversation loads again (the filesystem tier still holds its chunks).
        await supervisor.wait_for(CPU_TIER, ChildState.RUNNING, timeout=60, min_restarts=1)
        hits = published.stats.kv_offload_hits
        for attempt in range(5):  # each round evicts the one before from the small pool
            for i, answer in enumerate(answers):
                final = await complete(
                    client, follow_up(i, answer), greedy(MAX_TOKENS), f"r{attempt}-{i}"
                )
                assert list(final.outputs[0].token_ids) == want[len(answers) + i]
            if published.stats.kv_offload_hits > hits:
                break
            await asyncio.sleep(0.2)  # paces the bounded retries while the tier comes back
        assert published.stats.kv_offload_hits > hits, "no load after the CPU tier restarted"
