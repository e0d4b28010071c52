"""KV offload through the real actors (CPU tier, filesystem tier, worker copies, the engine core's
connector) on the in-memory bus and on a real NATS server: conversations whose first turns a
worker pool too small for them has evicted come back, and their prefixes load from the tiers
instead of being recomputed. Greedy outputs equal offload off; the counters show the loads."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from shoal.bus.base import Bus
from shoal.bus.memory import InMemoryBroker, InMemoryBus
from shoal.bus.messages.config import ShoalConfig
from shoal.bus.messages.engine import SchedulerStats
from shoal.deploy.deployment import CPU_TIER_TARGET, ActorPlan, plan_tiers, start_in_process
from shoal.engine.actor.core_actor import EngineCoreActor
from tests.fixtures.models import make_prompts
from tests.integration.async_workload import complete, greedy
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import EngineStack, engine_stack

pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

BLOCK_SIZE = 16
NUM_BLOCKS = 24  # 23 usable, about two conversations: the others' prefixes are evicted
FIRST_TURNS = make_prompts((150, 140, 160, 130), seed=7)
MAX_TOKENS = 6
Turns = list[list[int]]
_namespaces = itertools.count()


def offload_options(tmp_path: Path | None = None, cpu_bytes: int = 4 << 20) -> dict[str, Any]:
    extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes}
    if tmp_path is not None:
        extra["secondary_tiers"] = [{"type": "fs", "path": str(tmp_path), "bytes_to_use": 64 << 20}]
    return {
        "kv_transfer_config": {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    }


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


async def first_turns(built: EngineStack, tag: str) -> Turns:
    """Each first turn alone, one after the other (each evicts the one two before it)."""
    outputs = []
    for i, prompt in enumerate(FIRST_TURNS):
        final = await complete(built.client, prompt, greedy(MAX_TOKENS), f"t1-{i}{tag}")
        outputs.append(list(final.outputs[0].token_ids))
    return outputs


async def second_turns(built: EngineStack, answers: Turns, tag: str) -> Turns:
    """Each conversation returns: its first turn, the answer and a few new tokens."""
    outputs = []
    for i, (prompt, answer) in enumerate(zip(FIRST_TURNS, answers, strict=True)):
        follow_up = [*prompt, *answer, 40 + i, 41, 42, 43, 44]
        final = await complete(built.client, follow_up, greedy(MAX_TOKENS), f"t2-{i}{tag}")
        outputs.append(list(final.outputs[0].token_ids))
    return outputs


async def settled_stats(built: EngineStack) -> SchedulerStats:
    engine: EngineCoreActor = built.engines[0]
    core = engine.core
    assert core is not None
    await wait_for(lambda: not core.has_work(), 60, "the engine core settles")
    return engine._stats(core)


async def conversations(built: EngineStack, tag: str = "") -> Turns:
    answers = await first_turns(built, tag)
    return answers + await second_turns(built, answers, tag)


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
            return await conversations(built)
    finally:
        await bus.close()


def cpu_tier_plan(config: ShoalConfig) -> ActorPlan:
    return next(p for p in plan_tiers(config) if p.target == CPU_TIER_TARGET)


def _tier(built: EngineStack, kind: str) -> Any:
    return next(t for t in built.tiers if type(t).__name__ == kind)


async def test_cpu_tier_loads_returning_prefixes(bus_factory, model_dir, reference) -> None:  # type: ignore[no-untyped-def]
    async with stack(await bus_factory(), model_dir, **offload_options()) as built:
        assert await conversations(built) == reference
        stats = await settled_stats(built)
        cpu = _tier(built, "CpuTierActor").load()
    # Every second turn found its first turn's prompt chunks in the CPU tier (9 blocks or more).
    assert stats.kv_offload_hits >= 4 * 8 * BLOCK_SIZE
    assert stats.kv_offload_load_bytes > 0 and stats.kv_offload_store_bytes > 0
    assert cpu["num_hit_chunks"] >= 4 * 8


async def test_cpu_and_filesystem_tiers(bus_factory, model_dir, reference, tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with stack(await bus_factory(), model_dir, **offload_options(tmp_path)) as built:
        assert await conversations(built) == reference
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
        answers = await first_turns(built, "")
        await settled_stats(built)
        cpu = _tier(built, "CpuTierActor")
        await wait_for(lambda: cpu.load()["num_cascaded"] >= 8, 30, "chunks reached the fs tier")
        old_generation = _connector(built).region.generation
        await cpu.stop()
        (fresh,) = await start_in_process(bus, [cpu_tier_plan(built.engines[0].config)])
        built.tiers[built.tiers.index(cpu)] = fresh
        second = await second_turns(built, answers, "")
        stats = await settled_stats(built)
        assert _connector(built).region.generation != old_generation
        promoted = fresh.load()["num_promoted"]
    assert answers + second == reference
    assert promoted >= 8 and stats.kv_offload_hits > 0
