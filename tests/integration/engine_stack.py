"""Builds an engine stack (KV tiers when offload is on, workers, engine cores, an engine client)
in one event loop, on any bus: the harness of the end-to-end tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.bus.base import Bus
from shoal.bus.runtime.actor import Actor
from shoal.config.deployment import ShoalConfig
from shoal.deploy.deployment import plan_tiers, start_in_process
from shoal.engine.actor.core_actor import EngineCoreActor
from shoal.engine.client.engine_client import AsyncEngineClient
from shoal.workers.actor import WorkerActor


@dataclass
class EngineStack:
    client: AsyncEngineClient
    engines: list[EngineCoreActor]
    workers: list[WorkerActor]
    extra: dict[str, Any] = field(default_factory=dict)
    tiers: list[Actor] = field(default_factory=list)  # the KV offload tiers, CPU tier last


@contextlib.asynccontextmanager
async def engine_stack(
    bus: Bus,
    model_dir: Path,
    *,
    num_engines: int = 1,
    num_blocks: int = 256,
    block_size: int = 16,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 512,
    **options: Any,
) -> AsyncIterator[EngineStack]:
    """Workers ``w<rank>`` and engine cores ``e<rank>`` serving ``model_dir`` in fp32, plus a
    started client; ``options`` are more config options (``namespace``, ``max_model_len``...)."""
    config = ShoalConfig.from_options(
        model=str(model_dir),
        dtype="float32",
        num_gpu_blocks_override=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        **options,
    )
    workers, engines = [], []
    tiers = await start_in_process(bus, plan_tiers(config))
    try:
        for rank in range(num_engines):
            worker = WorkerActor(bus, f"w{rank}", config=config, heartbeat_interval_s=0.2)
            await worker.start()
            workers.append(worker)
            engine = EngineCoreActor(
                bus,
                f"e{rank}",
                config=config,
                worker_ids=[f"w{rank}"],
                dp_rank=rank,
                heartbeat_interval_s=0.2,
            )
            await engine.start()
            engines.append(engine)
        client = AsyncEngineClient(bus, config)
        await client.start()
        await client.wait_until_ready(30, num_engines)
        yield EngineStack(client, engines, workers, tiers=tiers)
        await client.close()
    finally:
        for actor in [*engines, *workers, *tiers]:
            await actor.stop()
