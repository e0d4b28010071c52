"""A step of an expert-parallel round that fails on one rank before its collectives (here: a
cached request the worker does not know) still runs them on no tokens, so the other rank's
step completes instead of waiting for the collective timeout; the failing rank raises its own
error. Two spawned ranks, each a ``ModelRunner`` of the tiny Mixtral joined at
``ep_init_method``."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.bus.messages.worker import CachedRequestData, ExecuteStep, NewRequestData
from tests.golden.driver import greedy, make_runner
from tests.unit.ep_ranks import COLLECTIVE_TIMEOUT_S, run_two_ranks

pytestmark = [pytest.mark.timeout(240)]


def rank_main(rank: int, port: int, dirs: dict[str, str], answers: Any) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        runner = make_runner(
            dirs["model"],
            num_blocks=32,
            block_size=16,
            data_parallel_size=2,
            enable_expert_parallel=True,
            step_timeout_s=COLLECTIVE_TIMEOUT_S,
        )
        runner.dp_rank, runner.ep_init_method = rank, f"tcp://127.0.0.1:{port}"
        runner.load()
        new = NewRequestData("a", [5, 6, 7, 8], greedy(4), [1], 0, 4)
        if rank == 0:  # names a request this worker never saw: fails in the diff
            step = ExecuteStep(1, cached_requests=[CachedRequestData("ghost", [], 3, 1)],
                               lockstep=True)  # fmt: skip
        else:
            step = ExecuteStep(1, new_requests=[new], lockstep=True)
        try:
            result = runner.execute(step)
            answers.put((rank, ("ok", result.sampled_token_ids)))
        except Exception as exc:
            answers.put((rank, ("raised", type(exc).__name__)))
    except Exception as exc:  # reported to the test, not swallowed
        answers.put((rank, ("setup", repr(exc))))


def test_a_rank_failing_before_its_collectives_does_not_stall_the_other(tiny_checkpoint):  # type: ignore[no-untyped-def]
    reports = run_two_ranks(rank_main, {"model": str(tiny_checkpoint("mixtral"))})
    assert reports[0] == ("raised", "KeyError"), reports
    status, sampled = reports[1]
    assert status == "ok" and len(sampled) == 1 and len(sampled[0]) == 1, reports
