"""The decode side's KV pull on its own (``workers.kv_pull``): ``plan_heads`` takes each of a
decode rank's KV heads from exactly one prefill rank that holds it (the first in order), in
head order, one copy per contiguous run, for every split of 4, 2 and 1 heads over 1, 2 and 4
ranks on either side; a head no source holds is a ``ValueError``. Real pulls out of caches
exported in memfds (``workers.kv_export``, fp32 and bf16, every element distinct) land the
model's KV head by head in the pulled blocks and nowhere else, whatever the two sides'
tensor-parallel sizes, and report the bytes they copied. A pull that cannot be trusted (wrong
token, other host, a new epoch before or during the copy, a block id out of range, lists of
unequal length, another geometry, a rank missing) fails alone: its request is reported, its
blocks are untouched, and the other pulls of the call land; a failure another rank reports
through ``agree`` fails the request too."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import product

import msgspec
import pytest
import torch

from shoal.bus.messages.kv_handover import KVExportRef, KVPull
from shoal.workers import kv_pull
from shoal.workers.kv_cache import KVCache
from shoal.workers.kv_canonical import CanonicalMapping, local_kv_heads
from shoal.workers.kv_export import ExportedKVCache, ExportViews
from shoal.workers.kv_pull import HeadCopy, plan_heads, run_kv_pulls

LAYERS, BLOCK, DIM = 2, 4, 8
REMOTE_BLOCKS, LOCAL_BLOCKS = 6, 8
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
TP_SIZES = (1, 2, 4)

Export = Callable[..., ExportedKVCache]


# ----- plan_heads, pure


def fake_ref(total_kv_heads: int, tp_size: int, tp_rank: int) -> KVExportRef:
    """A ref that is never opened: only its tensor-parallel fields matter to ``plan_heads``."""
    return KVExportRef(
        host="h",
        path=f"/nowhere/{tp_rank}",
        token="00" * 16,
        epoch=0,
        num_blocks=REMOTE_BLOCKS,
        num_layers=LAYERS,
        block_size=BLOCK,
        num_kv_heads=local_kv_heads(total_kv_heads, tp_size),
        head_dim=DIM,
        dtype="float32",
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_kv_heads=total_kv_heads,
    )


def fake_refs(total_kv_heads: int, tp_size: int) -> list[KVExportRef]:
    return [fake_ref(total_kv_heads, tp_size, rank) for rank in range(tp_size)]


def holds(ref: KVExportRef, head: int) -> bool:
    theirs = CanonicalMapping.of(ref.total_kv_heads, ref.tp_size, ref.tp_rank)
    return theirs.head_start <= head < theirs.head_start + theirs.num_heads


def as_tuples(copies: list[HeadCopy]) -> list[tuple[int, int, int, int]]:
    """(source rank, source head, destination head, heads) per copy."""
    return [(c.source.tp_rank, c.src_start, c.dst_start, c.num_heads) for c in copies]


def check_plan(sources: list[KVExportRef], mine: CanonicalMapping) -> None:
    copies = plan_heads(sources, mine)
    next_dst = 0
    for copy in copies:
        # In head order, back to back, covering this rank's heads once.
        assert copy.dst_start == next_dst and copy.num_heads > 0
        next_dst += copy.num_heads
        theirs = CanonicalMapping.of(
            copy.source.total_kv_heads, copy.source.tp_size, copy.source.tp_rank
        )
        # The source holds exactly these global heads at these local positions.
        assert copy.src_start >= 0 and copy.src_start + copy.num_heads <= theirs.num_heads
        assert theirs.head_start + copy.src_start == mine.head_start + copy.dst_start
        # Each head from the first source (in the order given) that holds it.
        for dst in range(copy.dst_start, copy.dst_start + copy.num_heads):
            first = next(ref for ref in sources if holds(ref, mine.head_start + dst))
            assert first is copy.source
    assert next_dst == mine.num_heads
    # Contiguous runs merged: one copy per source used.
    used = [copy.source.tp_rank for copy in copies]
    assert len(used) == len(set(used))


@pytest.mark.parametrize("total_kv_heads", [4, 2, 1])
def test_every_decode_head_comes_once_from_the_first_prefill_rank_holding_it(
    total_kv_heads: int,
) -> None:
    for prefill_tp, decode_tp in product(TP_SIZES, TP_SIZES):
        sources = fake_refs(total_kv_heads, prefill_tp)
        for rank in range(decode_tp):
            mine = CanonicalMapping.of(total_kv_heads, decode_tp, rank)
            check_plan(sources, mine)
            check_plan(sources[::-1], mine)  # replicas: the other one comes first


def test_plans_by_hand() -> None:
    four = fake_refs(4, 4)
    # Decode TP 1 from prefill TP 4: a head from each rank, in rank order.
    assert as_tuples(plan_heads(four, CanonicalMapping.of(4, 1, 0))) == [
        (0, 0, 0, 1),
        (1, 0, 1, 1),
        (2, 0, 2, 1),
        (3, 0, 3, 1),
    ]
    # Decode TP 2 rank 1 from prefill TP 1: heads 2 and 3 of the one rank, in one copy.
    assert as_tuples(plan_heads(fake_refs(4, 1), CanonicalMapping.of(4, 2, 1))) == [(0, 2, 0, 2)]
    # Decode TP 4 rank 3 (head 3) from prefill TP 2: the second head of rank 1.
    assert as_tuples(plan_heads(fake_refs(4, 2), CanonicalMapping.of(4, 4, 3))) == [(1, 1, 0, 1)]
    # Decode TP 2 rank 1 (head 2, 3) from prefill TP 4, given in reverse: rank 2, then 3.
    assert as_tuples(plan_heads(four[::-1], CanonicalMapping.of(4, 2, 1))) == [
        (2, 0, 0, 1),
        (3, 0, 1, 1),
    ]
    # Two heads replicated over prefill TP 4: head 1 is on ranks 2 and 3; the first given wins.
    two = fake_refs(2, 4)
    assert as_tuples(plan_heads(two, CanonicalMapping.of(2, 4, 3))) == [(2, 0, 0, 1)]
    assert as_tuples(plan_heads(two[::-1], CanonicalMapping.of(2, 4, 3))) == [(3, 0, 0, 1)]
    # One head: every rank of every side holds it.
    assert as_tuples(plan_heads(fake_refs(1, 2), CanonicalMapping.of(1, 4, 2))) == [(0, 0, 0, 1)]


def test_a_head_no_source_holds_is_a_value_error() -> None:
    rank0_of_two = [fake_ref(4, 2, 0)]
    with pytest.raises(ValueError, match="head 2"):
        plan_heads(rank0_of_two, CanonicalMapping.of(4, 1, 0))
    with pytest.raises(ValueError, match="head 2"):
        plan_heads(rank0_of_two, CanonicalMapping.of(4, 2, 1))
    assert as_tuples(plan_heads(rank0_of_two, CanonicalMapping.of(4, 2, 0))) == [(0, 0, 0, 2)]
    # Replicated heads: a replica stands in for a missing rank, both missing is an error.
    replicas = fake_refs(2, 4)
    assert as_tuples(plan_heads(replicas[1:], CanonicalMapping.of(2, 1, 0))) == [
        (1, 0, 0, 1),
        (2, 0, 1, 1),
    ]
    with pytest.raises(ValueError, match="head 0"):
        plan_heads(replicas[2:], CanonicalMapping.of(2, 2, 0))
    with pytest.raises(ValueError):
        plan_heads([], CanonicalMapping.of(1, 1, 0))


# ----- real pulls


@pytest.fixture
def export() -> Iterator[Export]:
    """Makes exported caches (closed at the end of the test)."""
    made: list[ExportedKVCache] = []

    def make(num_kv_heads: int, dtype: torch.dtype, head_dim: int = DIM) -> ExportedKVCache:
        cache = ExportedKVCache.allocate(
            num_layers=LAYERS,
            num_blocks=REMOTE_BLOCKS,
            block_size=BLOCK,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
        )
        made.append(cache)
        return cache

    yield make
    for cache in made:
        os.close(cache.fd)


def distinct_values(num: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``num`` distinct, finite, positive values (exact integers in fp32; normal bf16 bit
    patterns, so equality is equality of bits)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        return (torch.randperm(1 << 20, generator=gen)[:num] + 1).to(torch.float32)
    assert dtype == torch.bfloat16
    bits = torch.randperm(0x7F80 - 0x0080, generator=gen)[:num] + 0x0080  # exponent 1..254
    return bits.to(torch.int16).view(torch.bfloat16)


def stacked(cache: KVCache) -> torch.Tensor:
    """The cache as ``[layer, k|v, block, slot, head, dim]`` (a copy)."""
    return torch.stack([torch.stack([k, v]) for k, v in zip(cache.k, cache.v, strict=True)])


def fill(cache: KVCache, values: torch.Tensor) -> None:
    """Write ``[layer, k|v, block, slot, head, dim]`` values into the cache's pages."""
    for layer in range(len(cache.k)):
        cache.k[layer].copy_(values[layer, 0])
        cache.v[layer].copy_(values[layer, 1])


@dataclass
class PrefillSide:
    """A prefill engine core's workers: their exports, refs, and the model's KV they hold
    (``[layer, k|v, block, slot, head, dim]`` over every head)."""

    exports: list[ExportedKVCache]
    model_kv: torch.Tensor
    total_kv_heads: int
    dtype: torch.dtype

    def refs(self) -> list[KVExportRef]:
        tp_size = len(self.exports)
        return [
            cache.ref(
                tp_rank=rank,
                tp_size=tp_size,
                total_kv_heads=self.total_kv_heads,
                dtype=DTYPE_NAMES[self.dtype],
            )
            for rank, cache in enumerate(self.exports)
        ]


def prefill_side(
    export: Export, total_kv_heads: int, tp_size: int, dtype: torch.dtype, seed: int = 0
) -> PrefillSide:
    shape = (LAYERS, 2, REMOTE_BLOCKS, BLOCK, total_kv_heads, DIM)
    model_kv = distinct_values(torch.Size(shape).numel(), dtype, seed).view(shape)
    exports = []
    for rank in range(tp_size):
        theirs = CanonicalMapping.of(total_kv_heads, tp_size, rank)
        cache = export(theirs.num_heads, dtype)
        heads = slice(theirs.head_start, theirs.head_start + theirs.num_heads)
        fill(cache.kv_cache, model_kv[:, :, :, :, heads])
        exports.append(cache)
    return PrefillSide(exports, model_kv, total_kv_heads, dtype)


def decode_cache(mine: CanonicalMapping, dtype: torch.dtype, seed: int = 1) -> KVCache:
    """A decode rank's cache, every element distinct (from the prefill side's too: a bf16
    pattern has its top bit clear there, set here)."""
    cache = KVCache.allocate(
        num_layers=LAYERS,
        num_blocks=LOCAL_BLOCKS,
        block_size=BLOCK,
        num_kv_heads=mine.num_heads,
        head_dim=DIM,
        dtype=dtype,
        device="cpu",
    )
    shape = (LAYERS, 2, LOCAL_BLOCKS, BLOCK, mine.num_heads, DIM)
    values = distinct_values(torch.Size(shape).numel(), dtype, seed)
    values = -values if dtype == torch.bfloat16 else values + (1 << 20)
    fill(cache, values.view(shape))
    return cache


def landed(
    before: torch.Tensor,
    side: PrefillSide,
    mine: CanonicalMapping,
    block_ids: list[int],
    remote_block_ids: list[int],
) -> torch.Tensor:
    """What a decode cache holding ``before`` holds once the pull landed."""
    expected = before.clone()
    heads = slice(mine.head_start, mine.head_start + mine.num_heads)
    for local, remote in zip(block_ids, remote_block_ids, strict=True):
        expected[:, :, local] = side.model_kv[:, :, remote, :, heads]
    return expected


def pull_bytes(num_blocks: int, mine: CanonicalMapping, dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return LAYERS * 2 * num_blocks * BLOCK * mine.num_heads * DIM * itemsize


DTYPES = [torch.float32, torch.bfloat16]
BLOCK_IDS, REMOTE_IDS = [2, 7, 5], [4, 0, 3]  # scattered, neither side in order


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES.get)
def test_a_pull_from_two_prefill_ranks_lands_every_head_in_one_decode_rank(
    export: Export, dtype: torch.dtype
) -> None:
    side = prefill_side(export, total_kv_heads=4, tp_size=2, dtype=dtype)
    mine = CanonicalMapping.of(4, 1, 0)
    cache = decode_cache(mine, dtype)
    before = stacked(cache)
    pull = KVPull("r", BLOCK_IDS, REMOTE_IDS, side.refs())
    outcome = run_kv_pulls([pull], cache, mine=mine, views=ExportViews())
    assert outcome.failed_req_ids == []
    after = stacked(cache)
    # Head by head from the exporters' own pages: heads 0-1 are rank 0's, 2-3 rank 1's.
    for local, remote in zip(BLOCK_IDS, REMOTE_IDS, strict=True):
        for layer in range(LAYERS):
            for kv, pages in enumerate((side.exports[0].kv_cache.k, side.exports[0].kv_cache.v)):
                assert torch.equal(after[layer, kv, local, :, 0:2], pages[layer][remote])
            for kv, pages in enumerate((side.exports[1].kv_cache.k, side.exports[1].kv_cache.v)):
                assert torch.equal(after[layer, kv, local, :, 2:4], pages[layer][remote])
    # And nothing else changed.
    assert torch.equal(after, landed(before, side, mine, BLOCK_IDS, REMOTE_IDS))
    assert outcome.num_bytes == pull_bytes(len(BLOCK_IDS), mine, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES.get)
@pytest.mark.parametrize(
    ("total_kv_heads", "prefill_tp", "decode_tp"),
    [(4, 2, 1), (4, 1, 2), (4, 4, 2), (4, 2, 4), (2, 4, 1), (2, 1, 4), (1, 2, 4)],
)
def test_each_decode_rank_pulls_its_heads_whatever_the_two_sides_split(
    export: Export, dtype: torch.dtype, total_kv_heads: int, prefill_tp: int, decode_tp: int
) -> None:
    side = prefill_side(export, total_kv_heads, prefill_tp, dtype)
    refs = side.refs()
    views = ExportViews()
    for rank in range(decode_tp):
        mine = CanonicalMapping.of(total_kv_heads, decode_tp, rank)
        cache = decode_cache(mine, dtype, seed=1 + rank)
        before = stacked(cache)
        pull = KVPull("r", BLOCK_IDS, REMOTE_IDS, refs)
        outcome = run_kv_pulls([pull], cache, mine=mine, views=views)
        assert outcome.failed_req_ids == []
        assert torch.equal(stacked(cache), landed(before, side, mine, BLOCK_IDS, REMOTE_IDS))
        assert outcome.num_bytes == pull_bytes(len(BLOCK_IDS), mine, dtype)


def test_an_empty_pull_copies_nothing_and_succeeds(export: Export) -> None:
    side = prefill_side(export, 4, 2, torch.float32)
    mine = CanonicalMapping.of(4, 1, 0)
    cache = decode_cache(mine, torch.float32)
    before = stacked(cache)
    outcome = run_kv_pulls(
        [KVPull("r", [], [], side.refs())], cache, mine=mine, views=ExportViews()
    )
    assert outcome.failed_req_ids == [] and outcome.num_bytes == 0
    assert torch.equal(stacked(cache), before)


# ----- failed pulls

BAD_BLOCK_IDS, BAD_REMOTE_IDS = [4, 5], [1, 2]


def with_ref(side: PrefillSide, rank: int, **changes: object) -> list[KVExportRef]:
    refs = side.refs()
    refs[rank] = msgspec.structs.replace(refs[rank], **changes)
    return refs


def wrong_token(side: PrefillSide, export: Export) -> KVPull:
    return KVPull("bad", BAD_BLOCK_IDS, BAD_REMOTE_IDS, with_ref(side, 1, token="ab" * 16))


def other_host(side: PrefillSide, export: Export) -> KVPull:
    return KVPull("bad", BAD_BLOCK_IDS, BAD_REMOTE_IDS, with_ref(side, 0, host="x:elsewhere"))


def new_epoch(side: PrefillSide, export: Export) -> KVPull:
    refs = side.refs()
    side.exports[0].advance_epoch()  # the good pulls' refs are made after: epoch 1
    return KVPull("bad", BAD_BLOCK_IDS, BAD_REMOTE_IDS, refs)


def remote_block_out_of_range(side: PrefillSide, export: Export) -> KVPull:
    return KVPull("bad", BAD_BLOCK_IDS, [1, REMOTE_BLOCKS], side.refs())


def local_block_out_of_range(side: PrefillSide, export: Export) -> KVPull:
    return KVPull("bad", [4, LOCAL_BLOCKS], BAD_REMOTE_IDS, side.refs())


def unequal_lengths(side: PrefillSide, export: Export) -> KVPull:
    return KVPull("bad", BAD_BLOCK_IDS, [1], side.refs())


def other_head_dim(side: PrefillSide, export: Export) -> KVPull:
    wide = [export(2, torch.float32, head_dim=2 * DIM) for _ in range(2)]
    refs = [
        cache.ref(tp_rank=rank, tp_size=2, total_kv_heads=4, dtype="float32")
        for rank, cache in enumerate(wide)
    ]
    return KVPull("bad", BAD_BLOCK_IDS, BAD_REMOTE_IDS, refs)


def other_dtype(side: PrefillSide, export: Export) -> KVPull:
    halves = [export(2, torch.bfloat16) for _ in range(2)]
    refs = [
        cache.ref(tp_rank=rank, tp_size=2, total_kv_heads=4, dtype="bfloat16")
        for rank, cache in enumerate(halves)
    ]
    return KVPull("bad", BAD_BLOCK_IDS, BAD_REMOTE_IDS, refs)


def rank_missing(side: PrefillSide, export: Export) -> KVPull:
    return KVPull("bad", BAD_BLOCK_IDS, BAD_REMOTE_IDS, side.refs()[:1])


FAULTS = [
    wrong_token,
    other_host,
    new_epoch,
    remote_block_out_of_range,
    local_block_out_of_range,
    unequal_lengths,
    other_head_dim,
    other_dtype,
    rank_missing,
]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
def test_a_pull_that_cannot_be_trusted_fails_alone_and_writes_nothing(
    export: Export, fault: Callable[[PrefillSide, Export], KVPull]
) -> None:
    side = prefill_side(export, 4, 2, torch.float32)
    mine = CanonicalMapping.of(4, 1, 0)
    cache = decode_cache(mine, torch.float32)
    before = stacked(cache)
    bad = fault(side, export)
    refs = side.refs()
    pulls = [KVPull("a", [1, 2], [3, 0], refs), bad, KVPull("b", [6], [5], refs)]
    outcome = run_kv_pulls(pulls, cache, mine=mine, views=ExportViews())
    assert outcome.failed_req_ids == ["bad"]
    expected = landed(before, side, mine, [1, 2, 6], [3, 0, 5])  # blocks 4 and 5 untouched
    assert torch.equal(stacked(cache), expected)
    assert outcome.num_bytes == pull_bytes(3, mine, torch.float32)


def test_a_new_epoch_during_the_copy_fails_the_pull(
    export: Export, monkeypatch: pytest.MonkeyPatch
) -> None:
    side = prefill_side(export, 4, 2, torch.float32)
    mine = CanonicalMapping.of(4, 1, 0)
    cache = decode_cache(mine, torch.float32)
    copy_heads = kv_pull.copy_heads

    def copy_then_forget(*args: object, **kwargs: object) -> int:
        num_bytes = copy_heads(*args, **kwargs)  # type: ignore[arg-type]
        side.exports[1].advance_epoch()  # the prefill worker forgot its requests meanwhile
        return num_bytes

    monkeypatch.setattr(kv_pull, "copy_heads", copy_then_forget)
    pull = KVPull("r", BLOCK_IDS, REMOTE_IDS, side.refs())
    outcome = run_kv_pulls([pull], cache, mine=mine, views=ExportViews())
    assert outcome.failed_req_ids == ["r"]


def test_a_failure_another_rank_reports_fails_the_request_on_this_one(export: Export) -> None:
    side = prefill_side(export, 4, 2, torch.float32)
    mine = CanonicalMapping.of(4, 1, 0)
    cache = decode_cache(mine, torch.float32)
    before = stacked(cache)
    refs = side.refs()
    seen: list[list[bool]] = []

    def agree(failed: list[bool]) -> list[bool]:
        seen.append(list(failed))
        return [failed[0], True, failed[2]]  # another rank could not pull "b"

    pulls = [
        KVPull("a", [1], [3], refs),
        KVPull("b", [2], [4], refs),
        KVPull("c", [3], [1], with_ref(side, 0, token="cd" * 16)),
    ]
    outcome = run_kv_pulls(pulls, cache, mine=mine, views=ExportViews(), agree=agree)
    assert seen == [[False, False, True]]  # this rank's own failures, in pull order
    assert outcome.failed_req_ids == ["b", "c"]
    # "a" landed all the same.
    after = stacked(cache)
    assert torch.equal(after[:, :, 1], landed(before, side, mine, [1], [3])[:, :, 1])


def test_a_pull_from_more_ranks_than_views_keep_mapped_still_lands(export: Export) -> None:
    """Each source stays readable through its own mapping while the pull runs, however few
    caches the views keep mapped between pulls."""
    side = prefill_side(export, total_kv_heads=4, tp_size=4, dtype=torch.float32)
    mine = CanonicalMapping.of(4, 1, 0)
    cache = decode_cache(mine, torch.float32)
    before = stacked(cache)
    pull = KVPull("r", BLOCK_IDS, REMOTE_IDS, side.refs())
    outcome = run_kv_pulls([pull], cache, mine=mine, views=ExportViews(keep=1))
    assert outcome.failed_req_ids == []
    assert torch.equal(stacked(cache), landed(before, side, mine, BLOCK_IDS, REMOTE_IDS))


@pytest.mark.parametrize(
    "changes", [{"total_kv_heads": 8}, {"num_kv_heads": 1}], ids=["other_model", "bad_split"]
)
def test_a_ref_whose_heads_do_not_add_up_fails_the_pull(
    export: Export, changes: dict[str, int]
) -> None:
    side = prefill_side(export, total_kv_heads=4, tp_size=2, dtype=torch.float32)
    mine = CanonicalMapping.of(4, 1, 0)
    cache = decode_cache(mine, torch.float32)
    before = stacked(cache)
    refs = [msgspec.structs.replace(ref, **changes) for ref in side.refs()]
    outcome = run_kv_pulls(
        [KVPull("r", BLOCK_IDS, REMOTE_IDS, refs)], cache, mine=mine, views=ExportViews()
    )
    assert outcome.failed_req_ids == ["r"]
    assert torch.equal(stacked(cache), before)


def test_block_runs_follow_both_sides() -> None:
    from shoal.workers.kv_pull import block_runs

    assert block_runs([5, 6, 7, 9, 10], [0, 1, 2, 3, 4]) == [(5, 0, 3), (9, 3, 2)]
    assert block_runs([5, 6], [3, 9]) == [(5, 3, 1), (6, 9, 1)]
    assert block_runs([], []) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES.get)
def test_runs_of_consecutive_blocks_copy_slice_by_slice_with_the_same_result(
    export: Export, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks consecutive on both sides (as both sides mostly allocate) copy a slice per run;
    the gather is never used, and every head lands as through it."""
    side = prefill_side(export, total_kv_heads=4, tp_size=2, dtype=dtype)
    mine = CanonicalMapping.of(4, 1, 0)
    cache = decode_cache(mine, dtype)
    before = stacked(cache)
    monkeypatch.setattr(torch.Tensor, "index_copy_", None)  # the gather path would fail
    local, remote = [2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5]  # one run
    outcome = run_kv_pulls(
        [KVPull("r", local, remote, side.refs())], cache, mine=mine, views=ExportViews()
    )
    assert outcome.failed_req_ids == []
    assert torch.equal(stacked(cache), landed(before, side, mine, local, remote))
