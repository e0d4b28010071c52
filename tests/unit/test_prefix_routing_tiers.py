"""Prefix routing with the KV tiers' events: the index keeps a tier's chunks apart from any
device cache (``medium``), counts them a chunk at a time (the stride of their ``block_size``),
with the same gap and incarnation rules as an engine core's; the router adds what an engine
core's host CPU tier holds at ``TIER_BLOCK_WEIGHT``, below what its device cache holds; a tier
seen gone or restarted holds nothing known."""

from __future__ import annotations

from shoal.bus.messages.control import ActorState, Heartbeat, StatusEvent
from shoal.bus.messages.engine import EngineStats, SchedulerStats
from shoal.bus.messages.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from shoal.bus.subjects import Subjects
from shoal.bus.transport.memory import InMemoryBus
from shoal.config.deployment import ShoalConfig
from shoal.engine.client.prefix_index import PrefixIndex
from shoal.engine.client.prefix_routing import PrefixRouting
from shoal.engine.client.router import TIER_BLOCK_WEIGHT, EngineRouter
from tests.unit.test_prefix_routing import batch, h, picked

BLOCK = 4  # tokens per block
CHUNK = 2 * BLOCK  # a tier's chunk: two blocks, keyed by the second one's hash
PROMPT = [h(i) for i in range(6)]


def cpu(*hashes: bytes) -> BlockStored:
    return BlockStored(list(hashes), None, CHUNK, "cpu")


def test_a_tiers_chunks_count_a_stride_at_a_time_and_never_as_device_blocks() -> None:
    index = PrefixIndex(BLOCK)
    index.apply(batch("cpu-a", 0, AllBlocksCleared(), cpu(h(1), h(3))))
    assert index.stride("cpu-a", "cpu") == 2
    assert index.num_cached_blocks("cpu-a", PROMPT, "cpu") == 4  # chunks 0 and 1
    assert index.num_cached_blocks("cpu-a", PROMPT) == 0  # no device cache of its own
    assert index.num_cached_blocks("cpu-a", PROMPT, "cpu", start=3) == 4  # chunk 1 ends it
    assert index.num_cached_blocks("cpu-a", PROMPT, "cpu", start=5) == 5  # nothing further
    index.apply(batch("cpu-a", 1, BlockRemoved([h(1)])))  # another medium's: not the tier's
    assert index.num_cached_blocks("cpu-a", PROMPT, "cpu") == 4
    index.apply(batch("cpu-a", 2, BlockRemoved([h(1)], "cpu")))  # chunk 0 left
    assert index.num_cached_blocks("cpu-a", PROMPT, "cpu") == 0  # a prefix needs its head
    assert index.num_cached_blocks("cpu-a", PROMPT, "cpu", start=2) == 4  # the device has it


def test_a_tiers_gap_and_new_incarnation_drop_its_chunks_as_an_engine_cores() -> None:
    index = PrefixIndex(BLOCK)
    index.apply(batch("cpu-a", 0, AllBlocksCleared(), cpu(h(1))))
    index.apply(batch("cpu-a", 2, cpu(h(3))))  # seq 1 lost: not trusted
    assert index.num_gaps == 1 and index.hashes_of("cpu-a", "cpu") == set()
    index.apply(batch("cpu-a", 3, AllBlocksCleared(), cpu(h(1), h(3))))  # its snapshot
    assert index.hashes_of("cpu-a", "cpu") == {h(1), h(3)}
    index.apply(batch("cpu-a", 0, AllBlocksCleared(), incarnation="b"))  # restarted
    assert index.hashes_of("cpu-a", "cpu") == set()
    assert not index.apply(batch("cpu-a", 4, cpu(h(1))))  # the old life's late batch
    assert index.hashes_of("cpu-a", "cpu") == set()


def tier_router(loads: tuple[int, int], tiers: tuple[str, str]) -> EngineRouter:
    router = EngineRouter(index=PrefixIndex(BLOCK))
    for rank, (load, tier) in enumerate(zip(loads, tiers, strict=True)):
        stats = SchedulerStats(num_running=load)
        router.on_stats(EngineStats(f"e{rank}", stats, 0.0, kv_tier_id=tier), now=0.0)
    return router


def forget_picks(router: EngineRouter) -> None:
    for view in router.engines.values():
        view.num_sent_since_stats = 0


def test_an_engine_core_whose_cpu_tier_holds_the_prefix_wins_below_a_device_hit() -> None:
    router = tier_router(loads=(1, 0), tiers=("cpu-a", "cpu-b"))
    assert router.index is not None
    assert picked(router, PROMPT) == "e1"  # nothing held anywhere: the least loaded
    router.index.apply(batch("cpu-a", 0, cpu(h(1), h(3))))
    forget_picks(router)
    assert picked(router, PROMPT) == "e0"  # 4 blocks in its host's tier: 0.5 * 4 - 1 > 0
    forget_picks(router)
    router.index.apply(batch("e1", 0, BlockStored(PROMPT[:4])))  # e1's device holds them
    assert picked(router, PROMPT) == "e1"  # 4 device blocks beat 4 tier blocks
    assert TIER_BLOCK_WEIGHT < 1


def test_a_tier_gone_or_restarted_holds_nothing_known() -> None:
    config = ShoalConfig.from_options(model="m", block_size=BLOCK)
    routing = PrefixRouting(InMemoryBus(), Subjects(), config)
    index = routing.index
    index.apply(batch("cpu-a", 0, cpu(h(1)), incarnation="one"))
    routing.tiers.on_event(Heartbeat("cpu-a", "tier", 0, ActorState.READY, 0.0, incarnation="one"))
    routing.on_tier_change("cpu-a")
    assert index.hashes_of("cpu-a", "cpu") == {h(1)}
    routing.tiers.on_event(Heartbeat("cpu-a", "tier", 0, ActorState.READY, 0.5, incarnation="two"))
    routing.on_tier_change("cpu-a")  # restarted: its snapshot is not here yet
    assert index.hashes_of("cpu-a", "cpu") == set()
    index.apply(batch("cpu-a", 0, AllBlocksCleared(), cpu(h(1)), incarnation="two"))
    assert index.hashes_of("cpu-a", "cpu") == {h(1)}
    routing.tiers.on_event(StatusEvent("cpu-a", "tier", ActorState.DEAD, 1.0))
    routing.on_tier_change("cpu-a")
    assert index.hashes_of("cpu-a", "cpu") == set()
