"""Hosts of one deployment (one namespace: one object-tier bucket, one set of p2p peers) in one
event loop: each its own CPU tier (``<name>-cpu``) and secondary tiers (an object tier
``<name>-cpu-obj0`` by default), worker ``w-<name>`` and engine core ``e-<name>``; requests go
straight to a host's engine core (``BareClient``), so a conversation can start on one host and
go on on another."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bus.base import Bus
from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.runtime.actor import Actor
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.config.deployment import ShoalConfig
from shoal.deploy.deployment import CPU_TIER_TARGET, plan_tiers, start_in_process, stop_in_process
from shoal.engine.actor.core_actor import EngineCoreActor
from shoal.workers.actor import WorkerActor
from tests.integration.conditions import wait_for
from tests.integration.fault_tools import BareClient
from tests.integration.offload_workload import (
    BLOCK_SIZE,
    FIRST_TURNS,
    MAX_TOKENS,
    NUM_BLOCKS,
    Turns,
    follow_up,
    offload_options,
)

OBJ_TIER = {"type": "obj", "bytes_to_use": 64 << 20}
REPLY_S = 60.0  # a turn on one tiny model, however loaded the machine


def host_config(
    model_dir: Path,
    namespace: str,
    name: str,
    offload: bool = True,
    secondary_tiers: Sequence[dict[str, Any]] = (OBJ_TIER,),
    **more: Any,
) -> ShoalConfig:
    """One host's config; with ``offload`` a CPU tier of its own and ``secondary_tiers``;
    ``more``: more config options (``routing_mode``...)."""
    options: dict[str, Any] = {}
    if offload:
        tiers = list(secondary_tiers)
        options = offload_options(cpu_tier_id=f"{name}-cpu", secondary_tiers=tiers)
    return ShoalConfig.from_options(
        model=str(model_dir),
        dtype="float32",
        num_gpu_blocks_override=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=256,
        namespace=namespace,
        **options,
        **more,
    )


@dataclass
class Host:
    name: str
    config: ShoalConfig
    tiers: list[Actor]
    worker: WorkerActor
    engine: EngineCoreActor
    client: BareClient

    def tier(self, kind: str) -> Any:
        return next(t for t in self.tiers if type(t).__name__ == kind)

    @property
    def engine_id(self) -> str:
        return self.engine.engine_id

    async def turn(self, request_id: str, prompt: list[int]) -> list[int]:
        await self.client.add(self.engine_id, request_id, prompt, MAX_TOKENS)
        await wait_for(lambda: self.client.final(request_id) is not None, REPLY_S, request_id)
        return self.client.token_ids(request_id)

    async def first_turns(self) -> Turns:
        return [await self.turn(f"{self.name}-t1-{i}", p) for i, p in enumerate(FIRST_TURNS)]

    async def second_turns(self, answers: Turns, tag: str = "") -> Turns:
        return [
            await self.turn(f"{self.name}-t2-{i}{tag}", follow_up(i, answer))
            for i, answer in enumerate(answers)
        ]

    async def settled_stats(self) -> SchedulerStats:
        core = self.engine.core
        assert core is not None
        await wait_for(lambda: not core.has_work(), REPLY_S, f"{self.name} settles")
        stats = self.engine.stats()
        assert stats is not None
        return stats

    async def stop(self) -> None:
        await self.engine.stop()
        await self.worker.stop()
        await stop_in_process(self.tiers)


async def start_host(
    bus: Bus,
    model_dir: Path,
    namespace: str,
    name: str,
    offload: bool = True,
    secondary_tiers: Sequence[dict[str, Any]] = (OBJ_TIER,),
    **more: Any,
) -> Host:
    """A host's tiers, worker and engine core, started; returns once its CPU tier is attached
    (``more``: more config options)."""
    config = host_config(model_dir, namespace, name, offload, secondary_tiers, **more)
    tiers = await start_in_process(bus, plan_tiers(config))
    worker = WorkerActor(bus, f"w-{name}", config=config, heartbeat_interval_s=0.2)
    await worker.start()
    engine = EngineCoreActor(
        bus, f"e-{name}", config=config, worker_ids=[worker.actor_id], heartbeat_interval_s=0.2
    )
    await engine.start()
    client = await BareClient(bus, engine.subjects, f"bare-{name}").start()
    host = Host(name, config, tiers, worker, engine, client)

    def ready() -> bool:
        core = engine.core
        connector = core.scheduler.connector if core is not None else None
        return core is not None and (not offload or (connector is not None and connector.is_active))

    await wait_for(ready, REPLY_S, f"host {name} ready")
    return host


async def fresh_cpu_tier(bus: Bus, config: ShoalConfig, tiers: list[Actor]) -> Actor:
    """Stop the CPU tier of ``tiers`` (its region and index are gone) and start a new one of
    the same plan in its place; the engine core attaches to it by itself."""
    cpu = next(t for t in tiers if type(t).__name__ == "CpuTierActor")
    await cpu.stop()
    plan = next(p for p in plan_tiers(config) if p.target == CPU_TIER_TARGET)
    (fresh,) = await start_in_process(bus, [plan])
    tiers[tiers.index(cpu)] = fresh
    return fresh


async def reference_turns(model_dir: Path) -> Turns:
    """Offload off: both turns of every conversation computed on one host."""
    bus = InMemoryBus(InMemoryBroker())
    await bus.connect()
    host = await start_host(bus, model_dir, "offref", "ref", offload=False)
    try:
        answers = await host.first_turns()
        return answers + await host.second_turns(answers)
    finally:
        await host.stop()
        await bus.close()
