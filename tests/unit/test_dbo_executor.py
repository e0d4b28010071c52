"""The DBO ping-pong executor: strict alternation at yields (exactly one micro-batch runs at a
time), yields with nobody left to take the turn, results in order, the caller's torch modes in
the threads, and a failing micro-batch that neither deadlocks the other nor is swallowed.

Every run goes through ``run_bounded``: a hang fails the test instead of blocking it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import pytest
import torch

from shoal.workers.dbo.ubatching import (
    UBatchAborted,
    current_ubatch_id,
    dbo_enabled,
    dbo_yield,
    run_ubatches,
)

RUN_TIMEOUT_S = 10.0


def run_bounded(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """``run_ubatches(fns)`` in a helper thread joined with a timeout: its results, or the
    exception it raised. The helper runs under this thread's grad and inference modes (new
    threads do not inherit them), as the runner's thread would."""
    outcome: dict[str, Any] = {}
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def main() -> None:
        try:
            with torch.set_grad_enabled(grad), ExitStack() as stack:
                if inference:
                    stack.enter_context(torch.inference_mode())
                outcome["results"] = run_ubatches(fns)
        except BaseException as exc:
            outcome["error"] = exc

    runner = threading.Thread(target=main, daemon=True)
    runner.start()
    runner.join(RUN_TIMEOUT_S)
    assert not runner.is_alive(), "run_ubatches deadlocked"
    assert not [t for t in threading.enumerate() if t.name.startswith("ubatch-")]
    if "error" in outcome:
        raise outcome["error"]
    return outcome["results"]


def yielding(trace: list[tuple[int | None, int]], num_yields: int, result: Any = None):  # type: ignore[no-untyped-def]
    """A micro-batch that records (its id, segment) before each of its ``num_yields`` yields
    and once after the last."""

    def fn() -> Any:
        for segment in range(num_yields + 1):
            trace.append((current_ubatch_id(), segment))
            if segment < num_yields:
                dbo_yield()
        return result

    return fn


def test_two_micro_batches_alternate_strictly_at_each_yield() -> None:
    trace: list[tuple[int | None, int]] = []
    results = run_bounded([yielding(trace, 3, "a"), yielding(trace, 3, "b")])
    assert results == ["a", "b"]
    assert trace == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)]


def test_three_micro_batches_take_turns_in_id_order() -> None:
    trace: list[tuple[int | None, int]] = []
    run_bounded([yielding(trace, 2) for _ in range(3)])
    assert [ub for ub, _ in trace] == [0, 1, 2] * 3
    assert [seg for _, seg in trace] == [0] * 3 + [1] * 3 + [2] * 3


def test_a_yield_with_nobody_left_returns_at_once() -> None:
    """Micro-batch 0 finishes after one yield; micro-batch 1's further yields keep running."""
    trace: list[tuple[int | None, int]] = []
    assert run_bounded([yielding(trace, 1, 0), yielding(trace, 4, 1)]) == [0, 1]
    assert trace == [(0, 0), (1, 0), (0, 1), (1, 1), (1, 2), (1, 3), (1, 4)]
    trace.clear()
    assert run_bounded([yielding(trace, 2, "only")]) == ["only"]  # one micro-batch
    assert trace == [(0, 0), (0, 1), (0, 2)]


def test_outside_a_run_yield_does_nothing() -> None:
    assert not dbo_enabled() and current_ubatch_id() is None
    dbo_yield()  # returns: no turn to give away
    seen = run_bounded([lambda: (dbo_enabled(), current_ubatch_id())] * 2)
    assert seen == [(True, 0), (True, 1)]
    assert not dbo_enabled()


def test_a_nested_run_is_refused() -> None:
    with pytest.raises(RuntimeError, match="inside a micro-batch"):
        run_bounded([lambda: run_ubatches([lambda: None])])


def modes() -> tuple[bool, bool, bool]:
    made = torch.ones(1)
    return torch.is_inference_mode_enabled(), torch.is_grad_enabled(), made.is_inference()


def test_the_callers_inference_mode_holds_in_the_threads() -> None:
    with torch.inference_mode():
        assert run_bounded([modes, modes]) == [(True, False, True)] * 2
    with torch.no_grad():
        assert run_bounded([modes]) == [(False, False, False)]
    assert run_bounded([modes]) == [(False, True, False)]


def test_a_failure_after_a_yield_aborts_the_waiting_micro_batch() -> None:
    events: list[str] = []

    def first() -> None:
        events.append("0 before yield")
        try:
            dbo_yield()
        except UBatchAborted:
            events.append("0 aborted")
            raise
        events.append("0 resumed")  # must not happen

    def second() -> None:
        events.append("1 runs")
        raise ValueError("micro-batch 1 broke")

    with pytest.raises(ValueError, match="micro-batch 1 broke"):
        run_bounded([first, second])
    assert events == ["0 before yield", "1 runs", "0 aborted"]


def test_a_failure_before_the_first_yield_means_the_next_never_starts() -> None:
    started: list[int] = []

    def broken() -> None:
        started.append(0)
        raise KeyError("early")

    with pytest.raises(KeyError, match="early"):
        run_bounded([broken, lambda: started.append(1)])
    assert started == [0]


def test_a_failure_of_the_last_to_finish_is_raised_too() -> None:
    trace: list[tuple[int | None, int]] = []

    def late() -> None:
        dbo_yield()
        dbo_yield()  # micro-batch 0 is done by now: runs on
        raise OSError("late failure")

    with pytest.raises(OSError, match="late failure"):
        run_bounded([yielding(trace, 1), late])
    assert trace == [(0, 0), (0, 1)]
