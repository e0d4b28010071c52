"""The client's prefix index (incarnations, resets, gaps) and kv routing's scoring."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.bus.messages.control import ActorState, StatusEvent
from shoal.bus.messages.engine import EngineStats, SchedulerStats
from shoal.bus.messages.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from shoal.engine.client.prefix_index import PrefixIndex
from shoal.engine.client.router import EngineRouter, kv_score
from shoal.engine.core.block_hash import BlockHasher
from tests.unit.factories import make_request


def h(i: int) -> bytes:
    return i.to_bytes(4, "little")


def batch(engine: str, seq: int, *events: KVEvent, incarnation: str = "a") -> KVEventBatch:
    return KVEventBatch(engine, incarnation, seq, list(events))


def test_the_index_applies_stored_removed_and_cleared_in_order() -> None:
    index = PrefixIndex()
    index.apply(batch("e0", 0, AllBlocksCleared(), BlockStored([h(1), h(2), h(3)])))
    index.apply(batch("e1", 0, BlockStored([h(1)])))
    assert index.num_cached_blocks("e0", [h(1), h(2), h(3), h(4)]) == 3
    assert index.num_cached_blocks("e0", [h(9), h(2)]) == 0  # a prefix: stops at the first miss
    index.apply(batch("e0", 1, BlockRemoved([h(2)])))
    assert index.num_cached_blocks("e0", [h(1), h(2), h(3)]) == 1
    index.apply(batch("e0", 2, AllBlocksCleared(), BlockStored([h(7)])))
    assert index.hashes_of("e0") == {h(7)}
    assert index.hashes_of("e1") == {h(1)} and index.num_gaps == 0


def test_a_new_incarnation_drops_the_old_and_the_old_ones_late_batches_are_ignored() -> None:
    index = PrefixIndex()
    index.apply(batch("e0", 0, BlockStored([h(1), h(2)]), incarnation="a"))
    index.apply(batch("e0", 0, AllBlocksCleared(), BlockStored([h(5)]), incarnation="b"))
    assert index.hashes_of("e0") == {h(5)}
    assert not index.apply(batch("e0", 1, BlockStored([h(1)]), incarnation="a"))
    assert index.hashes_of("e0") == {h(5)}
    index.apply(batch("e0", 1, BlockStored([h(6)]), incarnation="b"))
    assert index.num_gaps == 0 and index.hashes_of("e0") == {h(5), h(6)}
    index.drop_source("e0")  # seen DEAD or STOPPED
    assert index.hashes_of("e0") == set()


def test_a_client_joining_mid_stream_counts_no_gap() -> None:
    index = PrefixIndex()
    index.apply(batch("e0", 41, BlockStored([h(1)])))  # the older batches left the stream
    index.apply(batch("e0", 42, BlockStored([h(2)])))
    assert index.num_gaps == 0 and index.hashes_of("e0") == {h(1), h(2)}


def test_the_client_hashes_a_prompt_as_the_engine_core_does() -> None:
    for salt in (None, "tenant-1"):
        hasher = BlockHasher(4)
        request = make_request("r", list(range(11)), cache_salt=salt)
        assert hasher.prompt_block_hashes(list(range(11)), salt) == hasher(request)
        assert hasher.prompt_block_hashes(list(range(11)), salt, 1) == hasher(request)[:1]


def stats(engine_id: str, num_running: int) -> EngineStats:
    return EngineStats(engine_id, SchedulerStats(num_running=num_running), 0.0)


def kv_router(load_weight: float = 1.0, loads: tuple[int, ...] = (0, 0)) -> EngineRouter:
    router = EngineRouter(index=PrefixIndex(), load_weight=load_weight)
    for rank, load in enumerate(loads):
        router.on_stats(stats(f"e{rank}", load), now=0.0)
    return router


def picked(router: EngineRouter, hashes: list[bytes]) -> str:
    view = router.pick(now=1.0, block_hashes=hashes)
    assert view is not None
    return view.engine_id


def test_kv_mode_sends_a_request_where_its_prefix_is_cached_weighed_against_load() -> None:
    router = kv_router(load_weight=1.0, loads=(0, 2))
    assert router.index is not None
    router.index.apply(batch("e1", 0, BlockStored([h(1), h(2), h(3), h(4)])))
    prompt = [h(1), h(2), h(3), h(4), h(5)]
    assert picked(router, prompt) == "e1"  # 4 - 2 beats 0 - 0
    assert picked(router, prompt) == "e1"  # 4 - 3 still beats 0 - 0
    assert picked(router, prompt) == "e0"  # 4 - 4 ties 0 - 0: the least loaded
    assert picked(router, [h(8)]) == "e0"  # no prefix anywhere: load decides
    assert router.num_prefix_routed == 2 and router.num_prefix_blocks == 8


def test_load_mode_and_a_request_without_full_blocks_route_by_load_alone() -> None:
    router = EngineRouter()
    router.on_stats(stats("e0", 0), now=0.0)
    router.on_stats(stats("e1", 2), now=0.0)
    assert picked(router, [h(1)]) == "e0"  # no index: load mode
    kv = kv_router(loads=(3, 0))
    assert kv.index is not None
    kv.index.apply(batch("e0", 0, BlockStored([h(1)])))
    assert picked(kv, []) == "e1"


def test_kv_mode_skips_an_engine_core_that_is_not_ready() -> None:
    router = kv_router()
    assert router.index is not None
    router.index.apply(batch("e0", 0, BlockStored([h(1), h(2)])))
    router.liveness.on_event(StatusEvent("e0", "engine", ActorState.UNHEALTHY, 0.0), now=0.5)
    assert picked(router, [h(1), h(2)]) == "e1"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 10)), min_size=1, max_size=4),
    st.floats(0, 3),
)
def test_the_pick_has_the_best_score_and_the_least_load_among_the_best(
    engines: list[tuple[int, int]], load_weight: float
) -> None:
    """engines: (cached prefix blocks, load) per engine core."""
    router = kv_router(load_weight, tuple(load for _, load in engines))
    assert router.index is not None
    prompt = [h(i) for i in range(8)]
    for rank, (cached, _) in enumerate(engines):
        router.index.apply(batch(f"e{rank}", 0, BlockStored(prompt[:cached])))
    choice = int(picked(router, prompt)[1:])
    scores = [kv_score(cached, load, load_weight) for cached, load in engines]
    best = max(scores)
    assert scores[choice] == best
    assert engines[choice][1] == min(
        load for (_, load), s in zip(engines, scores, strict=True) if s == best
    )


def test_an_engine_core_seen_dead_or_stopped_is_dropped_from_the_index() -> None:
    from shoal.bus.runtime.liveness import LivenessTable
    from shoal.bus.subjects import Subjects
    from shoal.bus.transport.memory import InMemoryBus
    from shoal.config.deployment import ShoalConfig
    from shoal.engine.client.prefix_routing import PrefixRouting

    routing = PrefixRouting(InMemoryBus(), Subjects(), ShoalConfig.from_options(model="m"))
    routing.index.apply(batch("e0", 0, BlockStored([h(1)])))
    routing.index.apply(batch("e1", 0, BlockStored([h(1)])))
    table = LivenessTable()
    table.on_event(StatusEvent("e0", "engine", ActorState.UNHEALTHY, 0.0), now=0.0)
    table.on_event(StatusEvent("e1", "engine", ActorState.DEAD, 0.0), now=0.0)
    for engine_id in ("e0", "e1"):
        routing.on_engine_change(engine_id, table)
    assert routing.index.hashes_of("e0") == {h(1)}  # unhealthy: may come back as it was
    assert routing.index.hashes_of("e1") == set()
    assert routing.block_hashes(list(range(33))) == routing.hasher.prompt_block_hashes(
        list(range(32))
    )  # 33 tokens: two full blocks, both usable (the last token is computed anyway)
