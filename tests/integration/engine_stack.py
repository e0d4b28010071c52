"""Builds an engine stack (workers, engine cores, an engine client) in one event loop, on any
bus: the harness of the end-to-end tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.bus.base import Bus
from shoal.engine.actor.core_actor import EngineCoreActor
from shoal.engine.client.engine_client import AsyncEngineClient
from shoal.workers.actor import WorkerActor


@dataclass
class EngineStack:
    client: AsyncEngineClient
    engines: list[EngineCoreActor]
    workers: list[WorkerActor]
    extra: dict[str, Any] = field(default_factory=dict)


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
    namespace: str = "shoal",
    **engine_options: Any,
) -> AsyncIterator[EngineStack]:
    workers, engines = [], []
    runner_options = {"dtype": "float32", "num_blocks": num_blocks, "block_size": block_size}
    try:
        for rank in range(num_engines):
            worker = WorkerActor(
                bus,
                f"w{rank}",
                model_dir=str(model_dir),
                runner_options=runner_options,
                namespace=namespace,
                heartbeat_interval_s=0.2,
            )
            await worker.start()
            workers.append(worker)
            engine = EngineCoreActor(
                bus,
                f"e{rank}",
                worker_ids=[f"w{rank}"],
                namespace=namespace,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                heartbeat_interval_s=0.2,
                **engine_options,
            )
            await engine.start()
            engines.append(engine)
        client = AsyncEngineClient(bus, str(model_dir), namespace=namespace)
        await client.start()
        await client.wait_until_ready(30, num_engines)
        yield EngineStack(client, engines, workers)
        await client.close()
    finally:
        for actor in [*engines, *workers]:
            await actor.stop()
