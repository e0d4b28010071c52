"""The canonical KV layout (``workers.kv_canonical``, ``workers.kv_transfer``): a chunk's bytes
are the same whatever tensor-parallel size wrote them. Every rank of TP=1, 2 and 4 (with 1, 2
and 4 KV heads: split or replicated) stores its heads through the real copy path into one
region, and the region equals the one TP=1 writes; every rank loads its heads back from TP=1's;
ranks that hold the same heads write only the chunks ``is_writer`` gives them. The pure mapping
is checked on bytes alone too (a hypothesis property: the writers of a slot cover it once)."""

from __future__ import annotations

from itertools import product
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.bus.messages.offload import KVLayout, KVLoad, KVStore, KVTransfers, RegionRef
from shoal.tiers.cpu.region import SharedRegion
from shoal.workers.kv_cache import KVCache
from shoal.workers.kv_canonical import CanonicalMapping, local_kv_heads
from shoal.workers.kv_transfer import KVGeometry, RegionViews, run_kv_transfers
from shoal.workers.layers.linear import qkv_linear
from shoal.workers.parallel import TPContext

LAYERS, BLOCK, DIM, NUM_BLOCKS, PER_CHUNK, SLOTS = 2, 4, 8, 16, 2, 6
SHAPES = [(heads, tp) for heads, tp in product((1, 2, 4), (1, 2, 4))]
# Blocks 1..12 into slots 0..5 (two per slot): runs of consecutive blocks (one pass each) ...
IN_RUNS = KVStore(1, list(range(1, 13)), [i // 2 for i in range(12)], [i % 2 for i in range(12)])
# ... or scattered (gathered first).
SCATTERED = KVStore(
    2, [9, 3, 14, 1, 7, 12, 5, 10], [5, 0, 3, 4, 1, 2, 0, 3], [0, 1, 1, 0, 0, 1, 0, 0]
)


def canonical(num_kv_heads: int) -> KVLayout:
    return KVLayout(
        "tiny-canonical", LAYERS, BLOCK, num_kv_heads, DIM, "float32", 1, PER_CHUNK, canonical=True
    )


def model_cache(num_kv_heads: int, seed: int = 0) -> KVCache:
    """The whole model's KV cache (every head), as TP=1 holds it; random, block 0 zero."""
    cache = KVCache.allocate(
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        num_kv_heads=num_kv_heads,
        head_dim=DIM,
        dtype=torch.float32,
        device="cpu",
    )
    gen = torch.Generator().manual_seed(seed)
    for tensor in cache.k + cache.v:
        tensor[1:] = torch.randn(tensor[1:].shape, generator=gen)
    return cache


def rank_cache(model: KVCache, mapping: CanonicalMapping) -> KVCache:
    """The heads ``mapping`` gives a rank, as its own (contiguous) KV cache."""
    heads = slice(mapping.head_start, mapping.head_start + mapping.num_heads)
    return KVCache(
        k=[t[:, :, heads].clone() for t in model.k],
        v=[t[:, :, heads].clone() for t in model.v],
        num_blocks=model.num_blocks,
        block_size=model.block_size,
    )


def region(tmp_path: Path, layout: KVLayout, name: str) -> SharedRegion:
    return SharedRegion.create("test", name, "g1", SLOTS, layout, directory=tmp_path)


def store(ref: RegionRef, cache: KVCache, job: KVStore, rank: int, tp_size: int) -> int:
    """Run ``job`` as rank ``rank`` of ``tp_size``; the bytes it stored."""
    result = run_kv_transfers(
        KVTransfers(ref, stores=[job]),
        cache,
        tp_rank=rank,
        tp_size=tp_size,
        regions=RegionViews(),
    )
    assert result.failed_store_job_ids == []
    return result.num_store_bytes


# ---- the real copy path ------------------------------------------------------------------------


@pytest.mark.parametrize("job", [IN_RUNS, SCATTERED], ids=["runs", "scattered"])
@pytest.mark.parametrize(("num_kv_heads", "tp_size"), SHAPES)
def test_every_tp_size_writes_the_bytes_tp1_writes(
    tmp_path: Path, num_kv_heads: int, tp_size: int, job: KVStore
) -> None:
    layout = canonical(num_kv_heads)
    model = model_cache(num_kv_heads)
    alone = region(tmp_path, layout, "tp1")
    assert store(alone.ref, model, job, 0, 1) == len(job.block_ids) * layout.rank_block_bytes
    shared = region(tmp_path, layout, f"tp{tp_size}")
    num_bytes = 0
    for rank in range(tp_size):
        mapping = CanonicalMapping.of(num_kv_heads, tp_size, rank)
        num_bytes += store(shared.ref, rank_cache(model, mapping), job, rank, tp_size)
    assert bytes(shared.view) == bytes(alone.view)
    # the slots hold the documented layout: [S, L, k|v, C, head, block_size, D]
    slots = torch.frombuffer(alone.view, dtype=torch.float32).view(
        SLOTS, LAYERS, 2, PER_CHUNK, num_kv_heads, BLOCK, DIM
    )
    for block, slot, offset in zip(job.block_ids, job.slot_ids, job.block_offsets, strict=True):
        for layer in range(LAYERS):
            for kv, cache in enumerate((model.k, model.v)):
                want = cache[layer][block].transpose(0, 1)  # [block_size, H, D] → [H, ...]
                assert torch.equal(slots[slot, layer, kv, offset], want)
    assert num_bytes == len(job.block_ids) * layout.rank_block_bytes  # each byte written once


@pytest.mark.parametrize(("num_kv_heads", "tp_size"), SHAPES)
def test_every_rank_loads_its_heads_of_what_tp1_wrote(
    tmp_path: Path, num_kv_heads: int, tp_size: int
) -> None:
    layout = canonical(num_kv_heads)
    model = model_cache(num_kv_heads)
    alone = region(tmp_path, layout, "tp1")
    store(alone.ref, model, IN_RUNS, 0, 1)
    # the chunk of slots 0..5 back into other blocks: 12 down to 1
    targets = list(range(12, 0, -1))
    load = KVLoad("r", targets, IN_RUNS.slot_ids, IN_RUNS.block_offsets)
    for rank in range(tp_size):
        mapping = CanonicalMapping.of(num_kv_heads, tp_size, rank)
        want = rank_cache(model, mapping)
        got = rank_cache(model_cache(num_kv_heads, seed=1), mapping)  # other bytes before
        result = run_kv_transfers(
            KVTransfers(alone.ref, loads=[load]),
            got,
            tp_rank=rank,
            tp_size=tp_size,
            regions=RegionViews(),
        )
        assert result.failed_load_req_ids == []
        share = layout.rank_block_bytes * mapping.num_heads // num_kv_heads
        assert result.num_load_bytes == 12 * share
        for layer in range(LAYERS):
            for mine, source in ((got.k, want.k), (got.v, want.v)):
                assert torch.equal(mine[layer][targets], source[layer][IN_RUNS.block_ids])


def test_replicated_ranks_take_turns_writing_chunks(tmp_path: Path) -> None:
    """2 KV heads on 4 ranks: ranks 0 and 1 hold head 0; rank 0 alone writes head 0 of the
    even slots only, rank 1 of the odd ones; neither touches head 1."""
    layout = canonical(2)
    model = model_cache(2)
    for rank in (0, 1):
        mapping = CanonicalMapping.of(2, 4, rank)
        assert (mapping.head_start, mapping.num_writers, mapping.writer_index) == (0, 2, rank)
        alone = region(tmp_path, layout, f"rank{rank}")
        store(alone.ref, rank_cache(model, mapping), IN_RUNS, rank, 4)
        # [S, L, 2, C, H, block_size, D]
        slots = torch.frombuffer(alone.view, dtype=torch.float32).view(
            SLOTS, LAYERS, 2, PER_CHUNK, 2, BLOCK, DIM
        )
        for slot in range(SLOTS):
            written = bool(torch.count_nonzero(slots[slot, :, :, :, 0]))
            assert written == mapping.is_writer(slot) == (slot % 2 == rank), (rank, slot)
        assert torch.count_nonzero(slots[:, :, :, :, 1]) == 0


def test_a_rank_that_writes_none_of_a_store_still_agrees_on_its_failure(tmp_path: Path) -> None:
    """One KV head on two ranks: rank 1 writes odd slots only. A store to slot 0 with a bad
    block is failed by rank 1 too (it validates what it does not write), and a store that
    failed on the other rank is skipped and reported here as well."""
    layout = canonical(1)
    mapping = CanonicalMapping.of(1, 2, 1)
    cache = rank_cache(model_cache(1), mapping)
    shared = region(tmp_path, layout, "agree")
    bad_block = KVStore(7, [NUM_BLOCKS], [0], [0])  # slot 0: rank 0's turn
    elsewhere = KVStore(8, [3, 4], [1, 1], [0, 1])  # slot 1: rank 1's turn
    seen: list[list[bool]] = []

    def agree(failed: list[bool]) -> list[bool]:  # the other rank failed job 8
        seen.append(failed)
        return [failed[0], True]

    result = run_kv_transfers(
        KVTransfers(shared.ref, stores=[bad_block, elsewhere]),
        cache,
        tp_rank=1,
        tp_size=2,
        regions=RegionViews(),
        agree=agree,
    )
    assert seen == [[True, False]]
    assert result.failed_store_job_ids == [7, 8] and result.num_store_bytes == 0
    assert not any(shared.view)


def test_a_canonical_layout_checks_this_ranks_share_of_the_heads() -> None:
    geometry = KVGeometry.of(model_cache(1), tp_size=2)  # one head per rank
    assert geometry.mismatch(canonical(2)) is None
    assert geometry.mismatch(canonical(1)) is None  # replicated on both ranks
    assert "2 per rank != 1" in str(geometry.mismatch(canonical(4)))
    assert "do not split" in str(geometry.mismatch(canonical(3)))
    per_rank = KVLayout("tiny-canonical", LAYERS, BLOCK, 2, DIM, "float32", 1, PER_CHUNK)
    assert KVGeometry.of(model_cache(2), 1).mismatch(per_rank) is None
    with pytest.raises(ValueError, match="one part"):
        KVLayout("t", LAYERS, BLOCK, 2, DIM, "float32", 2, PER_CHUNK, canonical=True)


# ---- the pure mapping --------------------------------------------------------------------------


@pytest.mark.parametrize(("num_kv_heads", "tp_size"), SHAPES)
def test_the_mapping_gives_each_rank_the_heads_its_projection_computes(
    num_kv_heads: int, tp_size: int
) -> None:
    for rank in range(tp_size):
        mapping = CanonicalMapping.of(num_kv_heads, tp_size, rank)
        qkv = qkv_linear(
            16,
            4,
            num_kv_heads,
            DIM,
            TPContext(rank, tp_size),
            bias=False,
            dtype=torch.float32,
            device="cpu",
        )
        rows, first, _ = qkv.shard_sizes["k"]
        assert (mapping.head_start, mapping.num_heads) == (first // DIM, rows // DIM)
        assert mapping.num_heads == local_kv_heads(num_kv_heads, tp_size)


def assemble(layout: KVLayout, tp_size: int, slot: int) -> tuple[bytes, bytes, list[int]]:
    """(a canonical chunk, the slot its ranks write from their own heads through their
    ``CopyRun`` when ``slot`` is their turn, how many times each byte was written)."""
    shape = (layout.num_layers, 2, layout.blocks_per_chunk, layout.num_kv_heads)
    shape += (layout.block_size, layout.head_dim)
    chunk = torch.arange(layout.slot_bytes // 2, dtype=torch.int16).view(shape)
    out, times = bytearray(layout.slot_bytes), [0] * layout.slot_bytes
    for rank in range(tp_size):
        mapping = CanonicalMapping.of(layout.num_kv_heads, tp_size, rank)
        heads = slice(mapping.head_start, mapping.head_start + mapping.num_heads)
        local = chunk[:, :, :, heads].contiguous().numpy().tobytes()  # the rank's own chunk
        run = mapping.run(layout)
        assert len(local) == run.local_offset + run.num_fragments * run.local_stride
        if not mapping.is_writer(slot):
            continue
        for i in range(run.num_fragments):
            start = run.canonical_offset + i * run.canonical_stride
            fragment = run.local_offset + i * run.local_stride
            out[start : start + run.fragment_size] = local[fragment : fragment + run.fragment_size]
            for j in range(start, start + run.fragment_size):
                times[j] += 1
    return chunk.numpy().tobytes(), bytes(out), times


@settings(max_examples=60, deadline=None)
@given(
    log_heads=st.integers(0, 3),
    log_tp=st.integers(0, 3),
    layers=st.integers(1, 3),
    block_size=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([1, 2, 4]),
    per_chunk=st.integers(1, 3),
    slot=st.integers(0, 7),
)
def test_the_writers_of_a_slot_write_each_byte_of_it_once(
    log_heads: int,
    log_tp: int,
    layers: int,
    block_size: int,
    head_dim: int,
    per_chunk: int,
    slot: int,
) -> None:
    num_kv_heads, tp_size = 1 << log_heads, 1 << log_tp
    layout = KVLayout(
        "p", layers, block_size, num_kv_heads, head_dim, "float16", 1, per_chunk, canonical=True
    )
    chunk, out, times = assemble(layout, tp_size, slot)
    assert out == chunk
    assert set(times) == {1}
