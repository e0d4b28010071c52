"""The KV copier on its own (``workers.kv_transfer``): a KV cache allocated here, regions made
with ``tiers.cpu.region.SharedRegion``: a rank's slice of a slot, batched stores then loads, job
and region validation, and the mapped generations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.bus.messages.offload import (
    KVLayout,
    KVLoad,
    KVStore,
    KVTransfers,
    RegionRef,
)
from shoal.tiers.cpu.region import SharedRegion
from shoal.workers import kv_copy
from shoal.workers.kv_cache import KVCache
from shoal.workers.kv_transfer import (
    MAX_DROPPED,
    DroppedLoads,
    RegionUnavailable,
    RegionViews,
    job_fault,
    run_kv_transfers,
)

LAYERS, BLOCK, HEADS, DIM, NUM_BLOCKS = 2, 4, 2, 8, 10


def layout(tp_size: int = 1, blocks_per_chunk: int = 1, **changes: object) -> KVLayout:
    fields: dict[str, object] = dict(
        model_tag="tiny",
        num_layers=LAYERS,
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_dim=DIM,
        dtype="float32",
        tp_size=tp_size,
        blocks_per_chunk=blocks_per_chunk,
    )
    fields.update(changes)
    return KVLayout(**fields)  # type: ignore[arg-type]


def kv_cache(seed: int | None = None) -> KVCache:
    cache = KVCache.allocate(
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_dim=DIM,
        dtype=torch.float32,
        device="cpu",
    )
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for t in cache.k + cache.v:
            t.copy_(torch.randn(t.shape, generator=gen))
    return cache


def region(tmp_path: Path, lay: KVLayout, num_slots: int = 4, tier: str = "t") -> SharedRegion:
    return SharedRegion.create("test", tier, "g1", num_slots, lay, directory=tmp_path)


def slots_of(shared: SharedRegion) -> torch.Tensor:
    """The test's own view of a region: ``[S, tp, L, 2, C, block, heads, dim]``."""
    lay = shared.ref.layout
    shape = (shared.ref.num_slots, lay.tp_size, lay.num_layers, 2, lay.blocks_per_chunk)
    return torch.frombuffer(shared.view, dtype=torch.float32).view(*shape, BLOCK, HEADS, DIM)


def run(transfers: KVTransfers, cache: KVCache, rank: int = 0, tp_size: int = 1, views=None):  # type: ignore[no-untyped-def]
    views = views if views is not None else RegionViews()
    return run_kv_transfers(transfers, cache, tp_rank=rank, tp_size=tp_size, regions=views)


def test_a_rank_stores_and_loads_only_its_own_part_of_a_slot(tmp_path: Path) -> None:
    lay = layout(tp_size=2)
    shared = region(tmp_path, lay)
    slots = slots_of(shared)
    slots[:, 0].fill_(7.0)  # rank 0's bytes, written by "another process"
    cache = kv_cache(seed=1)
    store = KVStore(job_id=5, block_ids=[3, 6], slot_ids=[2, 0], block_offsets=[0, 0])
    result = run(KVTransfers(shared.ref, stores=[store]), cache, rank=1, tp_size=2)
    assert result.failed_store_job_ids == [] and result.failed_load_req_ids == []
    assert result.num_store_bytes == 2 * lay.rank_block_bytes and result.num_load_bytes == 0
    assert torch.equal(slots[:, 0], torch.full_like(slots[:, 0], 7.0))
    for layer in range(LAYERS):
        for kv, pages in enumerate((cache.k, cache.v)):
            assert torch.equal(slots[2, 1, layer, kv, 0], pages[layer][3])
            assert torch.equal(slots[0, 1, layer, kv, 0], pages[layer][6])
    assert torch.count_nonzero(slots[1, 1]) == 0 and torch.count_nonzero(slots[3, 1]) == 0

    other = kv_cache()
    load = KVLoad("r", block_ids=[1, 9], slot_ids=[2, 0], block_offsets=[0, 0])
    loaded = run(KVTransfers(shared.ref, loads=[load]), other, rank=1, tp_size=2)
    assert loaded.num_load_bytes == 2 * lay.rank_block_bytes and loaded.failed_load_req_ids == []
    for mine, theirs in ((other.k, cache.k), (other.v, cache.v)):
        for layer in range(LAYERS):
            assert torch.equal(mine[layer][1], theirs[layer][3])
            assert torch.equal(mine[layer][9], theirs[layer][6])
            assert torch.count_nonzero(mine[layer][2:9]) == 0


def test_chunks_of_two_blocks_use_the_block_offsets(tmp_path: Path) -> None:
    lay = layout(blocks_per_chunk=2)
    shared = region(tmp_path, lay, num_slots=3)
    slots = slots_of(shared)
    cache = kv_cache(seed=2)
    stores = [
        KVStore(1, block_ids=[4, 5], slot_ids=[1, 1], block_offsets=[0, 1]),
        KVStore(2, block_ids=[7], slot_ids=[0], block_offsets=[1]),
    ]
    result = run(KVTransfers(shared.ref, stores=stores), cache)
    assert result.failed_store_job_ids == [] and result.num_store_bytes == 3 * lay.rank_block_bytes
    for layer in range(LAYERS):
        assert torch.equal(slots[1, 0, layer, 0, 0], cache.k[layer][4])
        assert torch.equal(slots[1, 0, layer, 1, 1], cache.v[layer][5])
        assert torch.equal(slots[0, 0, layer, 0, 1], cache.k[layer][7])
        assert torch.count_nonzero(slots[0, 0, layer, :, 0]) == 0
    other = kv_cache()
    load = KVLoad("r", block_ids=[2, 3, 8], slot_ids=[1, 1, 0], block_offsets=[1, 0, 1])
    assert run(KVTransfers(shared.ref, loads=[load]), other).failed_load_req_ids == []
    for layer in range(LAYERS):
        assert torch.equal(other.k[layer][2], cache.k[layer][5])
        assert torch.equal(other.v[layer][3], cache.v[layer][4])
        assert torch.equal(other.k[layer][8], cache.k[layer][7])


def test_stores_run_before_loads_in_one_step(tmp_path: Path) -> None:
    shared = region(tmp_path, layout())
    cache = kv_cache(seed=3)
    transfers = KVTransfers(
        shared.ref,
        loads=[KVLoad("r", [2], [1], [0])],
        stores=[KVStore(1, [6], [1], [0])],
    )
    run(transfers, cache)
    assert torch.equal(cache.k[1][2], cache.k[1][6]) and torch.equal(cache.v[0][2], cache.v[0][6])


def test_a_bad_job_fails_alone(tmp_path: Path) -> None:
    shared = region(tmp_path, layout(blocks_per_chunk=2), num_slots=2)
    cache = kv_cache(seed=4)
    before = [t.clone() for t in cache.k]
    loads = [
        KVLoad("slot", [1], [2], [0]),  # slot out of range
        KVLoad("block", [NUM_BLOCKS], [0], [0]),  # block out of range
        KVLoad("null", [0], [0], [0]),  # the null block
        KVLoad("offset", [1], [0], [2]),  # offset out of range
        KVLoad("lengths", [1, 2], [0], [0, 1]),  # unequal lists
        KVLoad("good", [3], [1], [1]),
    ]
    stores = [KVStore(1, [1], [0], [-1]), KVStore(2, [5], [1], [1]), KVStore(3, [1], [-1], [0])]
    result = run(KVTransfers(shared.ref, loads=loads, stores=stores), cache)
    assert result.failed_load_req_ids == ["slot", "block", "null", "offset", "lengths"]
    assert result.failed_store_job_ids == [1, 3]
    assert result.num_store_bytes == result.num_load_bytes == shared.ref.layout.rank_block_bytes
    for layer in range(LAYERS):
        assert torch.equal(cache.k[layer][3], before[layer][5])  # stored, then loaded back
        assert torch.equal(cache.k[layer][1], before[layer][1])  # no failed load touched it


def test_a_layout_no_tier_could_make_is_refused_on_construction() -> None:
    for bad in ({"dtype": "int8"}, {"blocks_per_chunk": 0}, {"num_kv_heads": 0}):
        with pytest.raises(ValueError, match=r"dtype|must be positive"):
            layout(**bad)


@pytest.mark.parametrize(
    "changes",
    [
        {"num_layers": 3},
        {"block_size": 8},
        {"num_kv_heads": 1},
        {"head_dim": 4},
        {"num_kv_heads": 4, "head_dim": 4},  # the same bytes per block
        {"dtype": "bfloat16"},
        {"tp_size": 2},
    ],
)
def test_a_layout_that_is_not_this_cache_fails_every_job(
    tmp_path: Path, changes: dict[str, object]
) -> None:
    """The region file exists and fits its own layout: only the layout check refuses it."""
    ref = region(tmp_path, layout(**changes), num_slots=2).ref
    cache = kv_cache(seed=5)
    before = [t.clone() for t in cache.k]
    transfers = KVTransfers(
        ref, loads=[KVLoad("a", [1], [0], [0])], stores=[KVStore(9, [2], [0], [0])]
    )
    views = RegionViews()
    result = run(transfers, cache, views=views)
    assert (result.failed_load_req_ids, result.failed_store_job_ids) == (["a"], [9])
    assert result.num_load_bytes == result.num_store_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(cache.k, before, strict=True))
    assert len(views) == 0


def test_a_region_gone_or_of_the_wrong_size_fails_every_job(tmp_path: Path) -> None:
    shared = region(tmp_path, layout())
    views = RegionViews()
    cache = kv_cache(seed=6)
    ok = run(KVTransfers(shared.ref, stores=[KVStore(1, [1], [0], [0])]), cache, views=views)
    assert ok.failed_store_job_ids == [] and len(views) == 1
    wrong_size = RegionRef(shared.ref.path, "g1", 5, shared.ref.layout)  # the file holds 4 slots
    transfers = KVTransfers(wrong_size, loads=[KVLoad("a", [2], [0], [0])])
    assert run(transfers, cache, views=views).failed_load_req_ids == ["a"]
    shared.close(unlink=True)  # the tier restarted: the mapping this worker holds is stale
    transfers = KVTransfers(
        shared.ref, loads=[KVLoad("a", [2], [0], [0]), KVLoad("b", [3], [0], [0])]
    )
    before = cache.k[0].clone()
    gone = run(transfers, cache, views=views)
    assert gone.failed_load_req_ids == ["a", "b"] and gone.num_load_bytes == 0
    assert torch.equal(cache.k[0], before) and len(views) == 0
    never = RegionRef(str(tmp_path / "never.kv"), "g0", 4, layout())
    failed = run(KVTransfers(never, stores=[KVStore(4, [1], [0], [0])]), cache, views=views)
    assert failed.failed_store_job_ids == [4]


def test_at_most_two_generations_stay_mapped(tmp_path: Path) -> None:
    regions = [region(tmp_path, layout(), tier=f"t{i}") for i in range(3)]
    views = RegionViews()
    first = views.view(regions[0].ref)
    assert views.view(regions[0].ref) is first  # mapped once
    views.view(regions[1].ref)
    views.view(regions[0].ref)  # used again: now the most recent
    views.view(regions[2].ref)
    assert len(views) == 2 and views.view(regions[0].ref) is first  # regions[1] went
    replaced = SharedRegion.create("test", "t0", "g1", 4, layout(), directory=tmp_path)
    assert replaced.ref == regions[0].ref  # same path and generation, a new file
    assert views.view(replaced.ref) is not first
    with pytest.raises(RegionUnavailable):
        views.view(RegionRef(str(tmp_path / "none.kv"), "g", 1, layout()))


def test_job_fault_names_what_is_wrong() -> None:
    limits = dict(num_blocks=8, num_slots=4, blocks_per_chunk=2)
    assert job_fault([1, 7], [0, 3], [0, 1], **limits) is None
    assert job_fault([], [], [], **limits) is None
    assert "block id 8" in str(job_fault([1, 8], [0, 0], [0, 0], **limits))
    assert "slot id 4" in str(job_fault([1], [4], [0], **limits))
    assert "block offset -1" in str(job_fault([1], [0], [-1], **limits))
    assert "2 block ids, 1 slot ids" in str(job_fault([1, 2], [0], [0, 0], **limits))


def test_dropped_requests_are_bounded_oldest_first() -> None:
    dropped = DroppedLoads()
    for i in range(MAX_DROPPED + 1):
        dropped.add(f"r{i}")
    assert len(dropped) == MAX_DROPPED and "r0" not in dropped and f"r{MAX_DROPPED}" in dropped
    dropped.forget(["r1", "unknown"])
    assert "r1" not in dropped and len(dropped) == MAX_DROPPED - 1


@pytest.mark.parametrize(
    ("blocks_per_chunk", "block_ids", "slot_ids", "offsets"),
    [
        # One block per chunk: consecutive blocks to consecutive slots (one run), then scattered.
        (1, [1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5, 6, 7, 8], [0] * 9),
        (1, [9, 2, 5, 1], [3, 0, 8, 4], [0] * 4),
        (1, [1, 5, 2, 7], [0, 1, 2, 3], [0] * 4),  # consecutive slots, scattered blocks
        # Two blocks per chunk: runs within a slot, broken between slots.
        (2, [1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 1, 1, 2, 2, 3, 3], [0, 1] * 4),
        (2, [1, 2, 3, 4, 5, 6, 7, 8], [3, 3, 2, 2, 1, 1, 0, 0], [0, 1] * 4),
        (2, [2, 3, 4, 5, 6, 7, 8], [0, 1, 1, 2, 2, 3, 3], [1, 0, 1, 0, 1, 0, 1]),  # mid-slot
    ],
    ids=["slot-runs", "scattered", "slots-run", "chunk-runs", "chunks-backwards", "mid-slot"],
)
@pytest.mark.parametrize("min_run", [1, 10**9], ids=["runs", "gather"])
def test_runs_and_scattered_batches_copy_the_same_bytes(
    tmp_path: Path, blocks_per_chunk: int, block_ids, slot_ids, offsets, min_run, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """Copied run by run (one pass each) or gathered, every block lands where the job says
    (checked row by row against the cache) and loads back unchanged."""
    monkeypatch.setattr(kv_copy, "MIN_BLOCKS_PER_RUN", min_run)
    shared = region(tmp_path, layout(blocks_per_chunk=blocks_per_chunk), num_slots=9)
    cache = kv_cache(seed=11)
    before = [t.clone() for t in cache.k + cache.v]
    views = RegionViews()
    run(
        KVTransfers(shared.ref, stores=[KVStore(1, block_ids, slot_ids, offsets)]),
        cache,
        views=views,
    )
    rows = slots_of(shared)[:, 0]  # [S, L, 2, C, block, heads, dim]
    for block, slot, offset in zip(block_ids, slot_ids, offsets, strict=True):
        for layer in range(LAYERS):
            assert torch.equal(rows[slot, layer, 0, offset], cache.k[layer][block])
            assert torch.equal(rows[slot, layer, 1, offset], cache.v[layer][block])
    for t in cache.k + cache.v:
        t.zero_()
    run(
        KVTransfers(shared.ref, loads=[KVLoad("a", block_ids, slot_ids, offsets)]),
        cache,
        views=views,
    )
    for restored, original in zip(cache.k + cache.v, before, strict=True):
        assert torch.equal(restored[block_ids], original[block_ids])


def test_a_job_another_rank_fails_is_skipped_here_too(tmp_path: Path) -> None:
    shared = region(tmp_path, layout())
    slots = slots_of(shared)
    cache = kv_cache(seed=6)
    before = [t.clone() for t in cache.k]
    loads = [
        KVLoad("here", [1], [9], [0]),
        KVLoad("there", [2], [0], [0]),
        KVLoad("ok", [3], [1], [0]),
    ]
    stores = [KVStore(1, [5], [0], [0]), KVStore(2, [6], [2], [0])]
    asked: list[list[bool]] = []

    def agree(mine: list[bool]) -> list[bool]:  # another rank fails load "there" and store 2
        asked.append(mine)
        return [mine[0], True, mine[2], mine[3], True]

    transfers = KVTransfers(shared.ref, loads=loads, stores=stores)
    result = run_kv_transfers(
        transfers, cache, tp_rank=0, tp_size=1, regions=RegionViews(), agree=agree
    )
    assert asked == [[True, False, False, False, False]]  # loads, then stores
    assert result.failed_load_req_ids == ["here", "there"] and result.failed_store_job_ids == [2]
    lay = shared.ref.layout
    assert result.num_store_bytes == result.num_load_bytes == lay.rank_block_bytes
    assert torch.count_nonzero(slots[2]) == 0  # store 2 never ran
    assert torch.equal(slots[0, 0, 0, 0, 0], before[0][5])  # store 1 did
    assert torch.equal(cache.k[0][2], before[0][2]) and not torch.equal(before[0][2], before[0][5])
    empty = KVTransfers(shared.ref)
    run_kv_transfers(empty, cache, tp_rank=0, tp_size=1, regions=RegionViews(), agree=agree)
    assert len(asked) == 1  # no job: nothing to agree on
