"""How prefix routing heals and what it counts: a seq gap drops an engine core's entries until
its next snapshot; a newer incarnation known from liveness drops the old one's; a request with
n > 1 counts n toward load; prompt-logprobs requests and single-engine deployments route by
load (no hashing); kv mode is the default only with several engine cores; events are cut into
batches that stay under the payload limit and replay to the same cache."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.bus.codec import encode
from shoal.bus.messages.control import ActorState, Heartbeat
from shoal.bus.messages.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.subjects import Subjects
from shoal.bus.transport.memory import InMemoryBus
from shoal.config.deployment import ShoalConfig
from shoal.engine.client.prefix_index import PrefixIndex
from shoal.engine.client.prefix_routing import PrefixRouting
from shoal.kv_events.publisher import UNIT_BYTES, max_units_for, split_events
from tests.unit.test_prefix_routing import batch, h, kv_router, picked


def test_a_gap_drops_the_engine_cores_entries_until_its_next_snapshot() -> None:
    index = PrefixIndex()
    index.apply(batch("e0", 0, AllBlocksCleared(), BlockStored([h(1), h(2)])))
    index.apply(batch("e1", 0, BlockStored([h(1)])))
    index.apply(batch("e0", 2, BlockStored([h(3)])))  # seq 1 (maybe a removal) lost
    assert index.num_gaps == 1 and index.hashes_of("e0") == set()
    index.apply(batch("e0", 3, BlockStored([h(4)])))  # still not trusted
    assert index.hashes_of("e0") == set() and index.num_gaps == 1
    index.apply(batch("e0", 4, AllBlocksCleared(), BlockStored([h(2), h(4)])))  # a snapshot
    index.apply(batch("e0", 5, BlockRemoved([h(2)])))
    assert index.hashes_of("e0") == {h(4)} and index.hashes_of("e1") == {h(1)}


def test_a_newer_incarnation_known_from_liveness_drops_the_old_ones_entries() -> None:
    router = kv_router(loads=(0, 1))
    index = router.index
    assert index is not None
    index.apply(batch("e1", 0, AllBlocksCleared(), BlockStored([h(1), h(2)]), incarnation="a"))
    beat = Heartbeat("e1", "engine", 0, ActorState.READY, 0.0, incarnation="a")
    router.liveness.on_event(beat, now=0.0)
    assert picked(router, [h(1), h(2)]) == "e1"  # 2 - 1 beats 0 - 0
    router.engines["e1"].num_sent_since_stats = 0
    restarted = Heartbeat("e1", "engine", 0, ActorState.READY, 0.5, incarnation="b")
    router.liveness.on_event(restarted, now=0.5)  # a new life; its snapshot not here yet
    assert picked(router, [h(1), h(2)]) == "e0"
    assert index.hashes_of("e1") == set() and index.incarnation_of("e1") == "b"
    assert not index.apply(batch("e1", 7, BlockStored([h(1)]), incarnation="a"))  # late, old
    index.apply(batch("e1", 0, AllBlocksCleared(), BlockStored([h(9)]), incarnation="b"))
    assert index.hashes_of("e1") == {h(9)}


def test_a_request_with_n_completions_counts_n_toward_load() -> None:
    router = kv_router(loads=(0, 0))
    view = router.pick(now=1.0, num_requests=4)
    assert view is not None and view.load == 4
    assert picked(router, []) != view.engine_id


def routing(**options: object) -> PrefixRouting:
    config = ShoalConfig.from_options(model="m", block_size=4, **options)
    return PrefixRouting(InMemoryBus(), Subjects(), config)


def test_prompt_logprobs_and_a_single_ready_engine_core_route_by_load() -> None:
    prefix = routing(routing_mode="kv")
    tokens = list(range(17))
    two, one = (lambda: ["e0", "e1"]), (lambda: ["e0"])
    assert len(prefix.request_hashes(tokens, SamplingParams(), two)) == 4
    assert prefix.request_hashes(tokens, SamplingParams(), one) == []
    assert prefix.request_hashes(tokens, SamplingParams(prompt_logprobs=1), two) == []


def test_kv_routing_is_the_default_only_with_several_engine_cores() -> None:
    def mode(**options: object) -> str:
        return ShoalConfig.from_options(model="m", **options).resolved_routing_mode

    assert mode() == "load"  # one engine core: nothing to choose
    assert mode(data_parallel_size=2, bus="nats") == "kv"
    assert mode(data_parallel_size=2, bus="nats", enable_prefix_caching=False) == "load"
    assert mode(routing_mode="kv") == "kv"  # asked for: kept
    assert mode(data_parallel_size=2, bus="nats", routing_mode="load") == "load"


def replay(runs: list[list[KVEvent]]) -> set[bytes]:
    held: set[bytes] = set()
    for run in runs:
        for event in run:
            match event:
                case AllBlocksCleared():
                    held.clear()
                case BlockStored():
                    held.update(event.block_hashes)
                case BlockRemoved():
                    held.difference_update(event.block_hashes)
    return held


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("scr"), st.lists(st.integers(0, 60), min_size=1, max_size=40)),
        max_size=8,
    ),
    st.integers(1, 12),
)
def test_split_events_keep_every_batch_small_and_replay_the_same(
    ops: list[tuple[str, list[int]]], max_units: int
) -> None:
    events: list[KVEvent] = []
    for kind, ids in ops:
        hashes = [h(i) for i in ids]
        events.append(
            AllBlocksCleared()
            if kind == "c"
            else BlockStored(hashes, h(99), 4)
            if kind == "s"
            else BlockRemoved(hashes)
        )
    runs = split_events(events, max_units)
    assert replay(runs) == replay([events])
    for run in runs:
        units = sum(1 + len(getattr(e, "block_hashes", [])) for e in run)
        assert units <= max(2, max_units) and run
    stored = [e for run in runs for e in run if isinstance(e, BlockStored)]
    chained = [s.block_hashes for s in stored]
    assert [x for c in chained for x in c] == [
        x for e in events if isinstance(e, BlockStored) for x in e.block_hashes
    ]
    starts = [s for s in stored if s.parent_block_hash == h(99)]  # an event's first piece
    assert len(starts) == sum(isinstance(e, BlockStored) for e in events)
    for before, piece in itertools.pairwise(stored):
        if piece.parent_block_hash != h(99):  # a continuation: chained to the piece before
            assert piece.parent_block_hash == before.block_hashes[-1]


def test_a_snapshot_cut_for_a_small_payload_fits_it() -> None:
    hashes = [bytes(32) for _ in range(1000)]  # sha256-sized
    max_payload = 4096
    runs = split_events([AllBlocksCleared(), BlockStored(hashes, None, 16)], max_units_for(4096))
    assert len(runs) > 1 and isinstance(runs[0][0], AllBlocksCleared)
    for seq, run in enumerate(runs):
        size = len(encode(KVEventBatch("engine-17", "incarnation-0123456789", seq, run, 1e9)))
        assert size <= max_payload // 2 + UNIT_BYTES
