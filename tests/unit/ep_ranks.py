"""Two spawned processes joined in a gloo group, for the expert-parallel and DBO tests: each
runs ``target(rank, port, dirs, answers)`` and puts one ``(rank, report)`` on ``answers``."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_model_runner_tp import free_port

COLLECTIVE_TIMEOUT_S = 30.0  # a rank that skips a collective fails the other within this
ANSWER_TIMEOUT_S = 150.0


def join_gloo(rank: int, port: int) -> None:
    """Join the two-rank gloo group of a spawned test process (one torch thread)."""
    from datetime import timedelta

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def run_two_ranks(target: Any, dirs: dict[str, str]) -> dict[int, Any]:
    """Run ``target(rank, port, dirs, answers)`` in two spawned processes; each rank's report."""
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, dirs, answers)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return dict(answers.get(timeout=ANSWER_TIMEOUT_S) for _ in procs)
    except queue_mod.Empty:
        pytest.fail("an EP rank did not answer: a collective hung")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
