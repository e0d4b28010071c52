"""KV offload through the real actors (CPU tier, filesystem tier, worker copies, the engine core's
connector) on the in-memory bus and on a real NATS server: conversations whose first turns a
worker pool too small for them has evicted come back, and their prefixes load from the tiers
instead of being recomputed. Greedy outputs equal offload off; the counters show the loads."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from shoal.bus.base import Bus
from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.msg import Msg
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.deploy.deployment import CPU_TIER_TARGET, plan_tiers, start_in_process
from shoal.engine.actor.core_actor import EngineCoreActor
from shoal.gateway.metrics import Metrics
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import EngineStack, engine_stack
from tests.integration.offload_workload import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    Turns,
    conversations,
    first_turns,
    offload_options,
    second_turns,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio]

_namespaces = itertools.count()


@contextlib.asynccontextmanager
async def stack(bus: Bus, model_dir: Path, **options: Any) -> AsyncIterator[EngineStack]:
    async with engine_stack(
        bus,
        model_dir,
        namespace=f"offload{next(_namespaces)}",  # its own tier ids and region files
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=256,
        **options,
    ) as built:
        if options.get("kv_transfer_config"):
            await wait_for(lambda: _connector(built).is_active, 30, "the CPU tier attached")
        yield built


def _connector(built: EngineStack) -> Any:
    core = built.engines[0].core
    assert core is not None and core.scheduler.connector is not None
    return core.scheduler.connector


async def settled_stats(built: EngineStack) -> SchedulerStats:
    engine: EngineCoreActor = built.engines[0]
    core = engine.core
    assert core is not None
    await wait_for(lambda: not core.has_work(), 60, "the engine core settles")
    stats = engine.stats()
    assert stats is not None
    return stats


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return tiny_checkpoint("llama")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(model_dir: Path) -> Turns:
    """Offload off: every returning conversation recomputes its prefix."""
    bus = InMemoryBus(InMemoryBroker())
    await bus.connect()
    try:
        async with stack(bus, model_dir) as built:
            return await conversations(built.client)
    finally:
        await bus.close()


async def restart_cpu_tier(
    bus: Bus, built: EngineStack, while_down: Callable[[], None] = lambda: None
) -> Any:
    """Once the first turns' chunks reached the filesystem tier, stop the CPU tier (its region
    and index are gone), run ``while_down``, and start a new one of the same plan."""
    await settled_stats(built)
    cpu = _tier(built, "CpuTierActor")
    await wait_for(lambda: cpu.load()["num_cascaded"] >= 8, 30, "chunks reached the fs tier")
    await cpu.stop()
    while_down()
    config = built.engines[0].config
    plan = next(p for p in plan_tiers(config) if p.target == CPU_TIER_TARGET)
    (fresh,) = await start_in_process(bus, [plan])
    built.tiers[built.tiers.index(cpu)] = fresh
    return fresh


def _tier(built: EngineStack, kind: str) -> Any:
    return next(t for t in built.tiers if type(t).__name__ == kind)


async def test_cpu_tier_loads_returning_prefixes(bus_factory, model_dir, reference) -> None:  # type: ignore[no-untyped-def]
    async with stack(await bus_factory(), model_dir, **offload_options()) as built:
        assert await conversations(built.client) == reference
        stats = await settled_stats(built)
        cpu = _tier(built, "CpuTierActor").load()
    # Every second turn found its first turn's prompt chunks in the CPU tier (9 blocks or more).
    assert stats.kv_offload_hits >= 4 * 8 * BLOCK_SIZE
    assert stats.kv_offload_load_bytes > 0 and stats.kv_offload_store_bytes > 0
    assert cpu["num_hit_chunks"] >= 4 * 8
    metrics = Metrics("tiny")
    metrics.update_engine_stats(stats, "e0")
    exposed = {
        sample.name: sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
    }
    assert exposed["vllm:kv_offload_hits_total"] == stats.kv_offload_hits
    assert exposed["vllm:kv_offload_load_bytes_total"] == stats.kv_offload_load_bytes
    assert 0 < exposed["vllm:kv_offload_cpu_cache_usage_perc"] <= 1


async def test_cpu_and_filesystem_tiers(bus_factory, model_dir, reference, tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with stack(await bus_factory(), model_dir, **offload_options(tmp_path)) as built:
        assert await conversations(built.client) == reference
        stats = await settled_stats(built)
    assert stats.kv_offload_hits >= 4 * 8 * BLOCK_SIZE
    assert list(tmp_path.rglob("*.bin")), "the chunks cascaded to the filesystem tier"


async def test_filesystem_tier_after_a_cpu_tier_restart(
    bus_factory, model_dir, reference, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """The CPU tier restarts (empty) between the turns: the prefixes come from the filesystem,
    promoted into the new CPU tier's region, and the engine core attaches to it by itself."""
    bus = await bus_factory()
    async with stack(bus, model_dir, **offload_options(tmp_path)) as built:
        answers = await first_turns(built.client)
        old_generation = _connector(built).region.generation
        fresh = await restart_cpu_tier(bus, built)
        second = await second_turns(built.client, answers)
        stats = await settled_stats(built)
        assert _connector(built).region.generation != old_generation
        promoted = fresh.load()["num_promoted"]
    assert answers + second == reference
    # Every returning turn loaded (the first lookup after the restart attached and retried).
    assert promoted >= 4 * 8 and stats.kv_offload_hits >= 4 * 8 * BLOCK_SIZE


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", [_flip_last_byte, _truncate], ids=["flipped", "truncated"])
async def test_damaged_chunk_files_are_recomputed(
    bus_factory, model_dir, reference, tmp_path, damage
) -> None:  # type: ignore[no-untyped-def]
    """Every chunk file is damaged while the CPU tier restarts: the filesystem tier detects it
    (checksum, length), reports misses, and the returning turns recompute correct tokens."""
    bus = await bus_factory()
    files: list[Path] = []

    def damage_every_file() -> None:
        files.extend(tmp_path.rglob("*.bin"))
        for path in files:
            damage(path)

    async with stack(bus, model_dir, **offload_options(tmp_path)) as built:
        answers = await first_turns(built.client)
        await restart_cpu_tier(bus, built, while_down=damage_every_file)
        second = await second_turns(built.client, answers)
        await settled_stats(built)
        fs = _tier(built, "FsTierActor").load()
    assert answers + second == reference
    assert fs["num_chunks_corrupt"] >= 1 and fs["num_chunks_loaded"] == 0
    assert files  # (the recomputed chunks are cascaded again: the files come back, sound)


async def test_a_silent_cpu_tier_costs_recomputes_not_a_hang(
    bus_factory, model_dir, reference
) -> None:  # type: ignore[no-untyped-def]
    """The CPU tier stops answering (slow or wedged): lookups time out, the requests recompute
    with the right tokens, and the failures are counted."""
    bus = await bus_factory()
    options = offload_options(kv_lookup_timeout_s=0.3)
    async with stack(bus, model_dir, **options) as built:
        answers = await first_turns(built.client)
        cpu = _tier(built, "CpuTierActor")
        subject = cpu.subjects.tier_in(cpu.actor_id)
        await cpu.stop()

        async def never_answer(msg: Msg) -> None:
            return None

        silent = await bus.subscribe(subject, never_answer)
        second = await second_turns(built.client, answers)
        stats = await settled_stats(built)
        await silent.unsubscribe()
    assert answers + second == reference
    assert stats.kv_offload_lookup_failures >= 1


@pytest.mark.parametrize("load_tiers", [None, ["cpu"]], ids=["all-tiers", "cpu-only"])
async def test_object_tier_after_a_cpu_tier_restart(
    bus_factory, model_dir, reference, load_tiers
) -> None:  # type: ignore[no-untyped-def]
    """The same with the object-store tier behind the CPU tier: the returning prefixes come
    from the bus's object store (the deployment's JetStream Object Store on NATS, the broker's
    own in memory), and the greedy outputs equal recompute. With ``kv_load_tiers=["cpu"]`` the
    returning requests may not load from the object tier: none is promoted, they recompute,
    and the outputs are the same."""
    bus = await bus_factory()
    obj_tier = {"type": "obj", "bytes_to_use": 64 << 20}
    async with stack(bus, model_dir, **offload_options(secondary_tiers=[obj_tier])) as built:
        answers = await first_turns(built.client)
        fresh = await restart_cpu_tier(bus, built)
        second = await second_turns(built.client, answers, kv_load_tiers=load_tiers)
        stats = await settled_stats(built)
        promoted = fresh.load()["num_promoted"]
        obj = _tier(built, "ObjTierActor").load()
    assert answers + second == reference
    if load_tiers is None:
        assert promoted >= 4 * 8 and obj["num_chunks_loaded"] >= 4 * 8
        assert stats.kv_offload_hits >= 4 * 8 * BLOCK_SIZE
    else:
        assert promoted == 0 and obj["num_chunks_loaded"] == 0
