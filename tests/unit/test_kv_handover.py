"""The prefill side of disaggregated prefill in the pure engine core: a request added with
``do_remote_decode`` that ends normally holds its prompt's KV blocks (says which, in its final
output) until a ``ReleaseKV`` or its lease ends; nothing else allocates them meanwhile; aborted
requests hold nothing, and a fault gives every hold back."""

from __future__ import annotations

import pytest

from shoal.bus.messages.engine import (
    AbortRequest,
    AddRequest,
    EngineCoreOutput,
    KVTransferParams,
    ReleaseKV,
)
from shoal.bus.messages.sampling import SamplingParams
from shoal.config.deployment import CacheConfig, SchedulerConfig
from shoal.engine.core.engine_core import EngineCore
from tests.unit.factories import FakeWorker

BLOCK_SIZE = 4
NUM_BLOCKS = 32


def make_core(async_scheduling: bool) -> EngineCore:
    return EngineCore(
        SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=8, async_scheduling=async_scheduling
        ),
        CacheConfig(block_size=BLOCK_SIZE),
        num_blocks=NUM_BLOCKS,
        max_model_len=128,
    )


def add(
    request_id: str, prompt_len: int, max_tokens: int = 1, remote_decode: bool = False
) -> AddRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = 10 + 37 * sum(map(ord, request_id)) % 150
    prompt = list(range(start, start + prompt_len))
    transfer = KVTransferParams(do_remote_decode=True) if remote_decode else None
    return AddRequest(request_id, prompt, params, "c", 0.0, kv_transfer_params=transfer)


def run(core: EngineCore, worker: FakeWorker, max_steps: int = 200) -> dict[str, EngineCoreOutput]:
    """Step until nothing runs; each request's final output."""
    finals: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        outputs, _ = core.apply_inputs()
        for output in (o for client in outputs.values() for o in client):
            finals[output.request_id] = output
        while core.can_schedule and (step := core.schedule()) is not None and not step.is_empty:
            pass
        if not core.outstanding:
            if not core.has_work():
                return finals
            continue
        step = core.outstanding[0]
        result = worker.execute(step.to_message())
        for output in (o for c in core.apply_result(step, result).values() for o in c):
            if output.finish_reason is not None:
                finals[output.request_id] = output
    raise AssertionError("the requests did not finish")


def free_block_ids(core: EngineCore) -> set[int]:
    return set(core.scheduler.kv_cache_manager.block_pool.free_block_ids())


def all_free(core: EngineCore) -> bool:
    return core.scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_remote_decode_prefill_holds_its_prompt_kv_until_released(
    async_scheduling: bool,
) -> None:
    core, worker = make_core(async_scheduling), FakeWorker(block_size=BLOCK_SIZE)
    core.admit(add("prefill", prompt_len=10, remote_decode=True))
    core.admit(add("local", prompt_len=9, max_tokens=3))
    finals = run(core, worker)
    params = finals["prefill"].kv_transfer_params
    assert finals["prefill"].finish_reason == "length"
    assert finals["local"].kv_transfer_params is None
    assert params is not None and params.num_remote_tokens == 10
    held = params.remote_block_ids
    assert len(held) == 3  # ceil(10 / 4): every block holding the prompt's KV, in order
    assert not set(held) & free_block_ids(core)  # allocated still, out of eviction
    assert core.scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 1 - 3
    # Meanwhile the cache fills up with other requests: none of them gets a held block.
    for i in range(4):
        core.admit(add(f"filler{i}", prompt_len=20, max_tokens=4))
    seen: set[int] = set()
    while core.has_work():
        core.apply_inputs()
        step = core.schedule()
        if step is None or step.is_empty:
            break
        for request in step.requests.values():
            seen.update(core.scheduler.kv_cache_manager.get_block_ids(request.request_id))
        core.apply_result(step, worker.execute(step.to_message()))
    assert seen and not seen & set(held)
    core.queue_release(ReleaseKV(["prefill", "unknown"]))
    core.apply_inputs()
    assert all_free(core) and core.scheduler.handovers.num_released == 1


def test_a_hold_nobody_releases_ends_with_its_lease() -> None:
    core, worker = make_core(async_scheduling=True), FakeWorker(block_size=BLOCK_SIZE)
    core.scheduler.handovers.lease_s = 0.0
    core.admit(add("prefill", prompt_len=7, remote_decode=True))
    finals = run(core, worker)
    assert finals["prefill"].kv_transfer_params is not None
    core.apply_inputs()  # the next step's inputs: the lease has run out
    assert all_free(core)
    assert core.scheduler.handovers.num_expired == 1 and core.scheduler.handovers.num_holding == 0


def test_an_aborted_prefill_holds_nothing_and_a_fault_gives_every_hold_back() -> None:
    core, worker = make_core(async_scheduling=False), FakeWorker(block_size=BLOCK_SIZE)
    core.admit(add("aborted", prompt_len=30, max_tokens=8, remote_decode=True))
    core.apply_inputs()
    step = core.schedule()
    assert step is not None
    core.queue_abort(AbortRequest(["aborted"]))
    outputs = core.apply_result(step, worker.execute(step.to_message()))
    (final,) = [o for c in outputs.values() for o in c if o.request_id == "aborted"]
    assert final.finish_reason == "abort" and final.kv_transfer_params is None
    assert all_free(core) and core.scheduler.handovers.num_held == 0
    core.admit(add("held", prompt_len=8, remote_decode=True))
    run(core, worker)
    assert core.scheduler.handovers.num_holding == 1
    core.fail_all("the workers are gone")
    assert core.scheduler.handovers.num_holding == 0 and all_free(core)
    assert not core.scheduler.kv_cache_manager.block_pool.num_cached_hashes  # the reset went on
