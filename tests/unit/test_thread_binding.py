"""CPU workers' cores (``--cpu-threads-bind``): the choice per worker, the option's syntax, and
the pinning itself, read back from the process (in a child process, so this one's threads are
left alone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shoal.config.deployment import ParallelConfig
from shoal.kernels.cpu_build import load_kernel_library
from shoal.workers.thread_binding import (
    ThreadBindError,
    WorkerSlot,
    parse_core_list,
    worker_cores,
)

SIXTEEN = list(range(16))


def test_core_lists_parse_and_bad_ones_are_refused():
    assert parse_core_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_core_list("5") == [5]
    for bad in ("", "a", "3-", "1,1", "0-2,2"):
        with pytest.raises(ThreadBindError):
            parse_core_list(bad)


def test_the_option_is_checked_where_the_config_is_made():
    for good in ("auto", "nobind", "0-1", "0-3|4-7", "0,2|1,3"):
        assert ParallelConfig(cpu_threads_bind=good).cpu_threads_bind == good
    for bad in ("all", "0-", "|0", "0||1", "0;1"):
        with pytest.raises(ValueError, match="cpu_threads_bind"):
            ParallelConfig(cpu_threads_bind=bad)


def test_auto_splits_the_cores_between_tensor_parallel_ranks_and_keeps_one_on_big_hosts():
    ranks = [worker_cores("auto", WorkerSlot(tp_rank=r, tp_size=2), SIXTEEN) for r in (0, 1)]
    assert ranks == [list(range(0, 7)), list(range(7, 14))]  # core 15 kept for the engine core
    assert worker_cores("auto", WorkerSlot(), [0, 1]) == [0, 1]  # small hosts keep none


def test_auto_splits_between_every_worker_of_one_process_only_with_the_memory_bus():
    def cores(dp_rank: int, shares: bool) -> list[int] | None:
        slot = WorkerSlot(dp_rank=dp_rank, dp_size=2, shares_process=shares)
        return worker_cores("auto", slot, [0, 1])

    assert [cores(0, True), cores(1, True)] == [[0], [1]]
    assert [cores(0, False), cores(1, False)] == [[0, 1], [0, 1]]  # processes on their own hosts


def test_more_workers_than_cores_get_one_core_each_in_turn():
    slots = [WorkerSlot(tp_rank=r, tp_size=4) for r in range(4)]
    assert [worker_cores("auto", s, [0, 1]) for s in slots] == [[0], [1], [0], [1]]


def test_explicit_lists_go_per_tensor_parallel_rank_or_per_worker():
    tp = [worker_cores("0-3|4-7", WorkerSlot(tp_rank=r, tp_size=2), SIXTEEN) for r in (0, 1)]
    assert tp == [[0, 1, 2, 3], [4, 5, 6, 7]]
    slot = WorkerSlot(tp_rank=1, tp_size=2, dp_rank=1, dp_size=2)
    assert worker_cores("0|1|2|3", slot, SIXTEEN) == [3]
    assert worker_cores("nobind", slot, SIXTEEN) is None
    with pytest.raises(ThreadBindError, match="3 core lists"):
        worker_cores("0|1|2", slot, SIXTEEN)
    with pytest.raises(ThreadBindError, match=r"cores \[20\]"):
        worker_cores("0-3|20", WorkerSlot(tp_rank=1, tp_size=2), SIXTEEN)


_CHILD = """
import json, sys, threading, torch
from shoal.workers.thread_binding import bind_worker_threads, thread_affinities, WorkerSlot
result = {}
def runner():
    result["cores"] = bind_worker_threads(sys.argv[1], WorkerSlot())
    a = torch.randn(256, 256)
    for _ in range(20):
        a @ a  # torch's parallel regions run on the bound team
    threads = thread_affinities()  # while its team lives (it ends with the runner thread)
    result["runner"] = threads[threading.get_native_id()]
    result["threads"] = list(threads.values())
    result["main"] = threads[main_id]
main_id = threading.get_native_id()
t = threading.Thread(target=runner)
t.start(); t.join()
result["num_threads"] = torch.get_num_threads()
print(json.dumps(result))
"""


def _bind_in_a_child(value: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, value],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    load_kernel_library("thread_binding") is None, reason="no C compiler: threads kept to the set"
)
def test_pinning_is_read_back_from_the_threads():
    available = sorted(os.sched_getaffinity(0))
    result = _bind_in_a_child("auto")
    assert result["cores"] == available and result["num_threads"] == len(available)
    assert result["runner"] == [available[0]]  # the runner thread is OpenMP thread 0
    pinned = sorted(cores[0] for cores in result["threads"] if len(cores) == 1)
    assert pinned == available  # one thread per core, each alone on it
    assert result["main"] == available  # the process's other threads are left alone


def test_an_explicit_single_core_runs_one_thread_there():
    core = max(os.sched_getaffinity(0))
    result = _bind_in_a_child(str(core))
    assert result == {**result, "cores": [core], "num_threads": 1, "runner": [core]}


@pytest.mark.parametrize("dp", [1, 2])
def test_llm_workers_bind_their_runner_threads(dp, tiny_checkpoint):
    """Through ``LLM`` (every actor in this process): each worker's runner thread takes the
    cores the option gives it, and the model still answers."""
    from shoal import LLM, SamplingParams
    from shoal.workers.actor import WorkerActor

    core = max(os.sched_getaffinity(0))
    value = "|".join([str(core)] * dp)
    options = dict(num_gpu_blocks_override=64, data_parallel_size=dp, cpu_threads_bind=value)
    with LLM(str(tiny_checkpoint("llama")), **options) as llm:
        workers = [a for a in llm._actors if isinstance(a, WorkerActor)]
        assert len(workers) == dp and all(w.bound_cores == [core] for w in workers)
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3


def test_auto_defers_to_an_explicit_omp_num_threads(monkeypatch):
    """Separate processes that each choose alone would all take the first cores: an explicit
    thread count is taken as it is, unpinned."""
    import torch

    from shoal.workers.thread_binding import bind_worker_threads

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        assert bind_worker_threads("auto", WorkerSlot()) is None
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
