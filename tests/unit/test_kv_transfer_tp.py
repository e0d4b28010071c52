"""KV offload copies with tensor parallelism, in two real ranks (processes, gloo): the ranks
agree on the failed jobs before any copy, so a store or load that fails on one rank only (its
view of the region is gone, or its copy of the step names a bad slot) fails on both, both drop
the same request and run the same forward (no mismatched collective), and a step without
copies costs no collective."""

from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path
from typing import Any

import pytest

from shoal.bus.messages.offload import KVLayout, RegionRef
from shoal.tiers.cpu.region import SharedRegion

BLOCK = 4
PROMPT = [17, 40, 93, 5, 250, 61, 8, 140, 33, 77, 12, 190, 66]  # 3 full blocks and 1 token
GROUP_TIMEOUT_S = 20.0  # a collective one rank never joins fails after this, not hangs
RESULT_TIMEOUT_S = 90.0
# The tiny llama split in two: each rank holds 1 of its 2 KV heads.
LAYOUT = KVLayout("tiny", 2, BLOCK, 1, 16, "float32", tp_size=2, blocks_per_chunk=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(ref: RegionRef, rank: int) -> list[Any]:
    """The engine core's steps, as ``rank`` receives them."""
    from shoal.bus.messages.offload import KVLoad, KVStore, KVTransfers
    from shoal.bus.messages.worker import CachedRequestData, ExecuteStep
    from tests.unit.test_model_runner import new

    # store job 12 names a slot out of range in rank 1's copy of the step only
    bad_slot = ref.num_slots if rank == 1 else 3
    stores = [KVStore(11, [1, 2, 3], [0, 1, 2], [0, 0, 0]), KVStore(12, [1], [bad_slot], [0])]
    loaded = new("b", PROMPT, [20, 21, 22, 23], len(PROMPT) - 3 * BLOCK)
    loaded.num_computed_tokens = 3 * BLOCK
    return [
        ExecuteStep(0, new_requests=[new("a", PROMPT, [1, 2, 3, 4], len(PROMPT))]),
        ExecuteStep(1, kv_transfers=KVTransfers(ref, stores=stores)),
        ExecuteStep(2, kv_transfers=KVTransfers(ref)),  # transfers, but no job
        ExecuteStep(  # rank 1 cannot map the region in this step
            3,
            new_requests=[loaded, new("c", PROMPT[:5], [30, 31], 5)],
            cached_requests=[CachedRequestData("a", [], len(PROMPT), 1)],
            kv_transfers=KVTransfers(ref, loads=[KVLoad("b", [20, 21, 22], [0, 1, 2], [0, 0, 0])]),
        ),
        ExecuteStep(  # sent before the engine core saw b's failure: b is left out
            4,
            cached_requests=[
                CachedRequestData("a", [], len(PROMPT) + 1, 1),
                CachedRequestData("b", [], len(PROMPT), 1),
                CachedRequestData("c", [], 5, 1),
            ],
        ),
    ]


def rank_main(rank: int, port: int, model_dir: str, ref: RegionRef, queue: Any) -> None:
    """One rank: runs the steps; rank 1's region view fails in step 3. Reports, per step,
    (req_ids, sampled tokens, kv_transfer, agreements so far) or the error."""
    import torch

    from shoal.workers.kv_transfer import RegionUnavailable
    from shoal.workers.parallel import destroy_tensor_parallel, init_tensor_parallel
    from tests.golden.driver import make_runner

    torch.set_num_threads(1)
    try:
        init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", timeout_s=GROUP_TIMEOUT_S)
        runner = make_runner(
            model_dir, num_blocks=64, block_size=BLOCK, tp_rank=rank, tensor_parallel_size=2
        )
        runner.load()
        agreements: list[list[bool]] = []
        agree = runner._agree_failures

        def counted(failed: list[bool]) -> list[bool]:
            agreements.append(failed)
            return agree(failed)

        runner._agree_failures = counted  # type: ignore[method-assign]
        views = runner.regions.view
        reports = []
        for step in _steps(ref, rank):
            gone = rank == 1 and step.step_id == 3

            def view(r: RegionRef, gone: bool = gone) -> torch.Tensor:
                if gone:
                    raise RegionUnavailable(f"region {r.path} is gone (as rank 1 sees it)")
                return views(r)

            runner.regions.view = view  # type: ignore[method-assign, assignment]
            result = runner.execute(step)
            reports.append(
                (result.req_ids, result.sampled_token_ids, result.kv_transfer, len(agreements))
            )
        queue.put((rank, reports, None))
    except Exception as exc:  # reported to the test, not swallowed
        queue.put((rank, None, repr(exc)))
    finally:
        destroy_tensor_parallel()


def run_ranks(model_dir: Path, ref: RegionRef) -> dict[int, list[Any]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=rank_main, args=(rank, port, str(model_dir), ref, queue))
        for rank in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, reports, error = queue.get(timeout=RESULT_TIMEOUT_S)
            assert error is None, f"rank {rank}: {error}"
            results[rank] = reports
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


@pytest.mark.timeout(150)
def test_ranks_fail_the_same_jobs_and_run_the_same_forward(tmp_path: Path, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    import torch

    shared = SharedRegion.create("test", "cpu", "g1", 4, LAYOUT, directory=tmp_path)
    results = run_ranks(tiny_checkpoint("llama", dtype="float32"), shared.ref)
    rank_bytes = LAYOUT.rank_block_bytes
    for rank in (0, 1):
        prefill, store, empty, load, after = results[rank]
        assert prefill[0] == ["a"] and prefill[2] is None and prefill[3] == 0  # no copies
        # store 12 fails on rank 1 only: both report it and skip it; store 11 runs on both
        assert store[2].failed_store_job_ids == [12], f"rank {rank}"
        assert store[2].num_store_bytes == 3 * rank_bytes and store[3] == 1
        assert empty[2].failed_store_job_ids == [] and empty[3] == 1  # no job, no collective
        # rank 1 cannot map the region: b's load fails on both, both drop b, a and c run
        assert load[2].failed_load_req_ids == ["b"] and load[2].num_load_bytes == 0
        assert load[0] == ["c", "a"] and load[3] == 2
        assert after[0] == ["a", "c"] and after[3] == 2
    for step in range(5):  # the same tokens on both ranks
        assert results[0][step][1] == results[1][step][1]
    slots = torch.frombuffer(shared.view, dtype=torch.float32).view(4, 2, -1)
    assert torch.count_nonzero(slots[3, 0]) == 0  # rank 0 skipped store 12 (slot 3)
    assert all(torch.count_nonzero(slots[s, r]) > 0 for s in (0, 1, 2) for r in (0, 1))


# ---- the engine core's side: every rank's copies in the step's result -------------------


def test_the_step_result_merges_every_ranks_kv_copies() -> None:
    from shoal.bus.codec import encode
    from shoal.bus.messages.offload import KVTransferResult
    from shoal.bus.messages.worker import ExecuteStep, StepResult
    from shoal.bus.msg import Msg
    from shoal.bus.subjects import Subjects
    from shoal.bus.transport.memory import InMemoryBus
    from shoal.engine.actor.worker_link import WorkerLink

    link = WorkerLink(InMemoryBus(), Subjects("t"), "e0", ["w0", "w1"])
    per_rank = [
        KVTransferResult(["x"], [5], 100, 10, load_time_s=0.5, store_time_s=0.1),
        KVTransferResult(["y", "x"], [7, 5], 100, 30, load_time_s=0.2, store_time_s=0.3),
    ]
    replies = [
        Msg(None, "r", encode(StepResult(3, ["a"], [[rank + 1]], kv_transfer=transfer)))
        for rank, transfer in enumerate(per_rank)
    ]
    result = link._decode_result(ExecuteStep(3), replies)
    assert result.sampled_token_ids == [[1]]  # rank 0's tokens
    assert result.kv_transfer == KVTransferResult(
        ["x", "y"], [5, 7], 200, 40, load_time_s=0.5, store_time_s=0.3
    )
    no_copies = [Msg(None, "r", encode(StepResult(4))) for _ in range(2)]
    assert link._decode_result(ExecuteStep(4), no_copies).kv_transfer is None
