"""KV offload copies inside the model runner: a prefix stored by a transfer-only step and loaded
into another request's blocks gives that request the tokens and KV of a run without offload; a
failed load drops its request alone (the engine core recomputes it) and a step naming the
dropped request later is harmless; the worker describes its KV geometry."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.bus.codec import Codec, encode
from shoal.bus.messages.offload import KVLayout, KVLoad, KVStore, KVTransfers, RegionRef
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import (
    CachedRequestData,
    ExecuteStep,
    NewRequestData,
    WorkerOutbound,
)
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.tiers.cpu.region import SharedRegion
from shoal.workers.actor import WorkerActor
from shoal.workers.model_runner import ModelRunner
from tests.golden.driver import make_runner
from tests.unit.test_model_runner import BLOCK, new

PROMPT = [17, 40, 93, 5, 250, 61, 8, 140, 33, 77, 12, 190, 66]  # 3 full blocks and 1 token
NUM_FULL = len(PROMPT) // BLOCK


@pytest.fixture
def runner(tiny_checkpoint):  # type: ignore[no-untyped-def]
    r = make_runner(tiny_checkpoint("llama"), num_blocks=64, block_size=BLOCK)
    r.load()
    return r


def make_region(tmp_path: Path, runner: ModelRunner, blocks_per_chunk: int = 1) -> SharedRegion:
    facts = runner.facts
    assert facts is not None
    layout = KVLayout(
        "tiny",
        facts.num_layers,
        facts.block_size,
        facts.num_kv_heads,
        facts.head_dim,
        facts.kv_dtype,
        tp_size=1,
        blocks_per_chunk=blocks_per_chunk,
    )
    return SharedRegion.create("test", "cpu", "g1", 6, layout, directory=tmp_path)


def kv_of(runner: ModelRunner, block: int) -> list[torch.Tensor]:
    return [t[block].clone() for t in runner.kv_cache.k + runner.kv_cache.v]


def loaded(req_id: str, blocks: list[int], num_computed: int) -> NewRequestData:
    """A new request whose first ``num_computed`` tokens come from a load."""
    data = new(req_id, PROMPT, blocks, len(PROMPT) - num_computed)
    data.num_computed_tokens = num_computed
    return data


def decode(req_id: str, num_computed: int) -> CachedRequestData:
    return CachedRequestData(req_id, [], num_computed, 1)


def prefill_and_store(
    runner: ModelRunner, region: RegionRef, slots: list[int], offsets: list[int]
) -> list[int]:
    """Request "a" on blocks 1-4: prefill, one decode, then its full blocks stored by a
    transfer-only step. Returns a's two tokens."""
    first = runner.execute(ExecuteStep(0, new_requests=[new("a", PROMPT, [1, 2, 3, 4], 13)]))
    second = runner.execute(ExecuteStep(1, cached_requests=[decode("a", 13)]))
    store = KVStore(11, [1, 2, 3], slots, offsets)
    only = runner.execute(ExecuteStep(2, kv_transfers=KVTransfers(region, stores=[store])))
    assert only.req_ids == [] and only.sampled_token_ids == [] and only.error is None
    assert only.kv_transfer is not None and only.kv_transfer.failed_store_job_ids == []
    assert only.kv_transfer.num_store_bytes == NUM_FULL * region.layout.rank_block_bytes
    return [*first.sampled_token_ids[0], *second.sampled_token_ids[0]]


@pytest.mark.parametrize(
    ("blocks_per_chunk", "slots", "offsets"),
    [(1, [4, 0, 2], [0, 0, 0]), (2, [5, 5, 1], [0, 1, 1])],
)
def test_a_loaded_prefix_gives_the_tokens_and_kv_of_a_run_without_offload(
    runner: ModelRunner,
    tmp_path: Path,
    blocks_per_chunk: int,
    slots: list[int],
    offsets: list[int],
) -> None:
    region = make_region(tmp_path, runner, blocks_per_chunk).ref
    expected = prefill_and_store(runner, region, slots, offsets)
    kv_a = [kv_of(runner, b) for b in (1, 2, 3, 4)]
    load = KVLoad("b", [20, 21, 22], slots, offsets)
    step = ExecuteStep(
        3,
        new_requests=[loaded("b", [20, 21, 22, 23], NUM_FULL * BLOCK)],
        finished_req_ids=["a"],
        kv_transfers=KVTransfers(region, loads=[load]),
    )
    result = runner.execute(step)
    assert result.req_ids == ["b"] and result.kv_transfer is not None
    assert result.kv_transfer.failed_load_req_ids == []
    assert result.kv_transfer.num_load_bytes == NUM_FULL * region.layout.rank_block_bytes
    second = runner.execute(ExecuteStep(4, cached_requests=[decode("b", 13)]))
    assert [*result.sampled_token_ids[0], *second.sampled_token_ids[0]] == expected
    for block_a, block_b in zip(kv_a[:NUM_FULL], (20, 21, 22), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(block_a, kv_of(runner, block_b), strict=True))
    assert all(
        torch.allclose(x, y, atol=1e-5) for x, y in zip(kv_a[3], kv_of(runner, 23), strict=True)
    )
    plain = runner.execute(ExecuteStep(5, new_requests=[new("c", PROMPT, [30, 31, 32, 33], 13)]))
    assert plain.sampled_token_ids[0] == expected[:1]  # no offload, fresh blocks


def test_failed_loads_drop_their_requests_alone(runner: ModelRunner, tmp_path: Path) -> None:
    region = make_region(tmp_path, runner).ref
    expected = prefill_and_store(runner, region, [0, 1, 2], [0, 0, 0])
    computed = NUM_FULL * BLOCK
    loads = [
        KVLoad("slot", [10, 11, 12], [0, 1, 6], [0, 0, 0]),  # slot 6 of 6
        KVLoad("block", [64, 15, 16], [0, 1, 2], [0, 0, 0]),  # block 64 of 64
        KVLoad("good", [20, 21, 22], [0, 1, 2], [0, 0, 0]),
    ]
    step = ExecuteStep(
        3,
        new_requests=[
            loaded("slot", [10, 11, 12, 13], computed),
            loaded("block", [14, 15, 16, 17], computed),
            loaded("good", [20, 21, 22, 23], computed),
            new("plain", PROMPT, [30, 31, 32, 33], 13),
        ],
        kv_transfers=KVTransfers(region, loads=loads, stores=[KVStore(12, [1], [0], [1])]),
    )
    result = runner.execute(step)
    assert result.kv_transfer is not None and result.error is None
    assert result.kv_transfer.failed_load_req_ids == ["slot", "block"]
    assert Codec(WorkerOutbound).decode(encode(result)) == result  # as the engine core reads it
    assert result.kv_transfer.failed_store_job_ids == [12]
    assert result.req_ids == ["good", "plain"]
    assert result.sampled_token_ids == [expected[:1], expected[:1]]
    assert "slot" not in runner.batch and "block" not in runner.batch
    # sent before the engine core saw the failure (async scheduling): left out, no error
    later = runner.execute(ExecuteStep(4, cached_requests=[decode("slot", 13), decode("good", 13)]))
    assert later.req_ids == ["good"] and later.sampled_token_ids == [expected[1:]]
    # the engine core preempts the dropped requests and re-sends them (one at once)
    gone = ExecuteStep(5, preempted_req_ids=["slot"], finished_req_ids=["good"])
    assert runner.execute(gone).error is None
    assert len(runner.batch) == 2  # "a" and "plain"
    greedy = SamplingParams(temperature=0.0)
    again = [
        NewRequestData(r, PROMPT, greedy, [b, b + 1, b + 2, b + 3], 0, 13, resumed=True)
        for r, b in (("slot", 40), ("block", 44))
    ]
    redo = runner.execute(ExecuteStep(6, new_requests=again))
    assert redo.req_ids == ["slot", "block"] and redo.sampled_token_ids == [expected[:1]] * 2
    assert redo.kv_transfer is None


@pytest.mark.parametrize("fault", ["gone", "layout"])
def test_a_region_that_cannot_be_used_fails_every_load(
    runner: ModelRunner, tmp_path: Path, fault: str
) -> None:
    shared = make_region(tmp_path, runner)
    expected = prefill_and_store(runner, shared.ref, [0, 1, 2], [0, 0, 0])
    region = shared.ref
    if fault == "gone":
        shared.close(unlink=True)
    else:
        region = RegionRef(region.path, region.generation, region.num_slots, _regrouped(region))
    loads = [KVLoad(r, [b, b + 1, b + 2], [0, 1, 2], [0, 0, 0]) for r, b in (("x", 10), ("y", 20))]
    step = ExecuteStep(
        3,
        new_requests=[
            loaded("x", [10, 11, 12, 13], NUM_FULL * BLOCK),
            new("plain", PROMPT, [30, 31, 32, 33], 13),
            loaded("y", [20, 21, 22, 23], NUM_FULL * BLOCK),
        ],
        kv_transfers=KVTransfers(region, loads=loads),
    )
    result = runner.execute(step)
    assert result.kv_transfer is not None
    assert result.kv_transfer.failed_load_req_ids == ["x", "y"]
    assert result.req_ids == ["plain"] and result.sampled_token_ids == [expected[:1]]
    assert len(runner.batch) == 2  # "a" and "plain"
    finished = runner.execute(ExecuteStep(4, finished_req_ids=["x", "y", "plain"]))
    assert finished.error is None and len(runner.batch) == 1


def _regrouped(region: RegionRef) -> KVLayout:
    """Twice the heads of half the size: the same bytes per block, another layout."""
    lay = region.layout
    return KVLayout(
        lay.model_tag,
        lay.num_layers,
        lay.block_size,
        lay.num_kv_heads * 2,
        lay.head_dim // 2,
        lay.dtype,
        lay.tp_size,
        lay.blocks_per_chunk,
    )


def test_a_seeded_request_dropped_by_a_failed_load_keeps_its_random_stream(
    runner: ModelRunner, tmp_path: Path
) -> None:
    """Dropped when its load fails, then preempted by the engine core and re-sent: the second
    removal must not lose the generator the first one parked."""
    region = make_region(tmp_path, runner).ref
    params = SamplingParams(temperature=1.0, seed=21)
    first = NewRequestData("s", PROMPT, params, [1, 2, 3, 4], 0, 13)
    tokens = runner.execute(ExecuteStep(0, new_requests=[first])).sampled_token_ids[0]
    generator = runner.requests["s"].generator
    assert generator is not None
    back = NewRequestData("s", PROMPT, params, [5, 6, 7, 8], 12, 2, tokens, resumed=True)
    bad = KVLoad("s", [5, 6, 7], [0, 1, 9], [0, 0, 0])
    step = ExecuteStep(1, preempted_req_ids=["s"], new_requests=[back])
    step.kv_transfers = KVTransfers(region, loads=[bad])
    assert runner.execute(step).req_ids == []
    runner.execute(ExecuteStep(2, preempted_req_ids=["s"]))
    redo = NewRequestData("s", PROMPT, params, [9, 10, 11, 12], 0, 14, tokens, resumed=True)
    runner.execute(ExecuteStep(3, new_requests=[redo]))
    assert runner.requests["s"].generator is generator


def test_the_worker_describes_its_kv_geometry(runner: ModelRunner) -> None:
    facts = runner.facts
    assert facts is not None
    assert (facts.num_layers, facts.num_kv_heads, facts.head_dim, facts.kv_dtype) == (
        2,
        2,
        16,
        "float32",
    )
    actor = WorkerActor(InMemoryBus(InMemoryBroker()), "w0", runner=runner)
    actor.facts = facts
    info = actor.describe()
    assert (info.num_layers, info.num_kv_heads, info.head_dim, info.kv_dtype) == (
        2,
        2,
        16,
        "float32",
    )
