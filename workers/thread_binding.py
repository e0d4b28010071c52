"""Which cores a CPU worker's threads run on, and pinning them there (vLLM's
``VLLM_CPU_OMP_THREADS_BIND``, here ``--cpu-threads-bind``).

- ``auto`` (default): the cores this process may use, less one kept for the engine core and the
  gateway on hosts of 8 or more, split evenly between the workers that share them: the
  tensor-parallel ranks of a worker group, and with the in-memory bus (``LLM``) every worker of
  every data-parallel rank, which all live in one process. An explicit ``OMP_NUM_THREADS``
  wins: that many threads, nothing pinned.
- ``nobind``: torch's own thread count, nothing pinned.
- a list per worker, ``0-3|4-7`` (each ``a-b,c,...``): tensor-parallel rank r takes list r; with
  as many lists as data-parallel × tensor-parallel workers, worker ``dp_rank * tp + tp_rank``.

Binding runs in the thread that runs the model (the worker's runner thread): torch uses as many
threads as cores, and each OpenMP thread of that thread's team is pinned to one core
(``kernels/cpu/thread_binding.c``); without a C compiler the team is kept to the set instead.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.kernels.cpu_build import load_kernel_library

log = logging.getLogger(__name__)
AUTO, NOBIND = "auto", "nobind"
RESERVE_FROM_CORES = 8  # hosts this large keep a core for the engine core and the gateway


class ThreadBindError(ValueError):
    """A ``--cpu-threads-bind`` value that names no usable cores for this worker."""


@dataclass(frozen=True)
class WorkerSlot:
    """Where a worker sits among the workers that may share its host's cores."""

    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    shares_process: bool = False  # every worker in one process (the in-memory bus)


def parse_core_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` → ``[0, 1, 2, 3, 8, 10, 11]``."""
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ThreadBindError(f"cpu_threads_bind: {text!r} is not a core list like 0-3,8")
        cores.extend(range(int(first), int(last or first) + 1))
    if not cores or len(set(cores)) != len(cores):
        raise ThreadBindError(f"cpu_threads_bind: {text!r} names no cores or repeats one")
    return cores


def worker_cores(value: str, slot: WorkerSlot, available: list[int]) -> list[int] | None:
    """The cores for the worker at ``slot`` (None: ``nobind``), within ``available``."""
    if value == NOBIND:
        return None
    if value == AUTO:
        return _auto_cores(slot, available)
    lists = [parse_core_list(part) for part in value.split("|")]
    if len(lists) == slot.tp_size:
        cores = lists[slot.tp_rank]
    elif len(lists) == slot.tp_size * slot.dp_size:
        cores = lists[slot.dp_rank * slot.tp_size + slot.tp_rank]
    else:
        raise ThreadBindError(
            f"cpu_threads_bind {value!r} has {len(lists)} core lists: give one per "
            f"tensor-parallel rank ({slot.tp_size}) or per worker ({slot.tp_size * slot.dp_size})"
        )
    outside = sorted(set(cores) - set(available))
    if outside:
        raise ThreadBindError(f"cpu_threads_bind names cores {outside} this process may not use")
    return cores


def _auto_cores(slot: WorkerSlot, available: list[int]) -> list[int]:
    cores = available[:-1] if len(available) >= RESERVE_FROM_CORES else available
    sharers = slot.tp_size * (slot.dp_size if slot.shares_process else 1)
    index = slot.tp_rank + (slot.dp_rank * slot.tp_size if slot.shares_process else 0)
    share = len(cores) // sharers
    if share == 0:  # more workers than cores: each runs on all of them, one thread
        return cores[index % len(cores) : index % len(cores) + 1]
    return cores[index * share : (index + 1) * share]


def available_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def bind_worker_threads(value: str, slot: WorkerSlot) -> list[int] | None:
    """Pick this worker's cores and pin the calling (runner) thread's team to them; returns
    the cores (None: nothing pinned). ``auto`` defers to an explicit ``OMP_NUM_THREADS``: that
    many threads, unpinned (processes that each pick alone would all pick the same cores)."""
    omp_threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value == AUTO and omp_threads.isdigit() and int(omp_threads) > 0:
        torch.set_num_threads(int(omp_threads))
        log.info("worker threads: %s (OMP_NUM_THREADS), not pinned", omp_threads)
        return None
    cores = worker_cores(value, slot, available_cores())
    if cores is None:
        return None
    pinned = bind_threads(cores)
    log.info(
        "worker threads: %d on cores %s (%s)",
        len(cores),
        ",".join(map(str, cores)),
        "one core each" if pinned else "kept to the set",
    )
    return cores


def bind_threads(cores: list[int]) -> bool:
    """Run torch on ``len(cores)`` threads, each OpenMP thread of the calling thread's team
    pinned to one core; returns whether they were pinned one by one (else the whole team is
    kept to the set). Call it from the thread that runs the model."""
    torch.set_num_threads(len(cores))
    os.sched_setaffinity(0, cores)  # this thread, and threads it starts, stay in the set
    lib = load_kernel_library("thread_binding")
    if lib is None:
        return False
    fn = lib.bind_omp_threads
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    failed = fn((ctypes.c_int * len(cores))(*cores), len(cores))
    if failed:
        log.warning("%d of %d threads could not be pinned to cores %s", failed, len(cores), cores)
    return failed == 0


def thread_affinities() -> dict[int, list[int]]:
    """Every thread of this process and the cores it may run on (read back from /proc)."""
    result: dict[int, list[int]] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            result[int(task.name)] = sorted(os.sched_getaffinity(int(task.name)))
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
    return result
