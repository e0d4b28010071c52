"""The dual-batch-overlap executor: one thread per micro-batch, in strict ping-pong.

``run_ubatches(fns)`` runs each function in its own thread; exactly one thread runs at a time.
The main thread hands the first turn to micro-batch 0 and waits for all. A micro-batch gives
its turn away only at ``dbo_yield()`` (vLLM's ``_cpu_yield``: signal the next, wait on your own
event) or by finishing; the turn goes to the next unfinished micro-batch in id order, so a yield
with nobody else left returns at once. The MoE all-to-all calls ``dbo_yield()`` after issuing a
collective, so the other micro-batch computes while it is in flight; outside ``run_ubatches``
``dbo_yield()`` does nothing.

Ordering: the interleaving depends only on how many yields each micro-batch makes before each
point, never on timing, so two runs of the same model over the same number of micro-batches
issue their collectives in the same order whatever their token counts (what the EP ranks rely
on). The turn is also what orders the paged KV cache: micro-batch 1 reaches a layer's attention
only after micro-batch 0 passed it, so a request cut at the split sees its first part's KV.

Failure: the first exception raised in a micro-batch is re-raised by ``run_ubatches``; every
other micro-batch is woken and unwinds with ``UBatchAborted`` from its pending wait (at its
start or at a ``dbo_yield``), so no thread is left blocked here.

The threads run under the caller's grad and inference mode (``torch.inference_mode`` is
thread-local and new threads do not inherit it) and, on CUDA, its current device and stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_local = threading.local()  # .ctx: the UBatchContext of the micro-batch this thread runs


class UBatchAborted(RuntimeError):
    """Raised inside a micro-batch's thread when another micro-batch of the run failed."""


class _PingPong:
    """The turn shared by the micro-batches of one run: one event per micro-batch, set when it
    is its turn. Only the thread holding the turn touches ``done``/``failed`` (or a failing
    thread, which holds it too), so no lock is needed."""

    def __init__(self, num_ubatches: int) -> None:
        self.events = [threading.Event() for _ in range(num_ubatches)]
        self.done = [False] * num_ubatches
        self.failed: BaseException | None = None

    def pass_turn(self, me: int) -> bool:
        """Wake the next unfinished micro-batch after ``me``; False when there is none."""
        n = len(self.events)
        for step in range(1, n):
            other = (me + step) % n
            if not self.done[other]:
                self.events[other].set()
                return True
        return False

    def wait_turn(self, me: int) -> None:
        self.events[me].wait()
        self.events[me].clear()
        if self.failed is not None:
            raise UBatchAborted(f"micro-batch {me} aborted: another micro-batch failed")

    def finish(self, me: int, error: BaseException | None) -> None:
        self.done[me] = True
        if error is None:
            self.pass_turn(me)
            return
        if self.failed is None:
            self.failed = error
        for event in self.events:  # wake everyone: they see `failed` and unwind
            event.set()


@dataclass(frozen=True)
class UBatchContext:
    """The micro-batch this thread runs: its id and its run's turn."""

    id: int
    turn: _PingPong


def current_ubatch_id() -> int | None:
    """The id of the micro-batch this thread runs, or None outside ``run_ubatches``."""
    ctx = getattr(_local, "ctx", None)
    return None if ctx is None else ctx.id


def dbo_enabled() -> bool:
    """Whether this thread runs a micro-batch of ``run_ubatches``."""
    return getattr(_local, "ctx", None) is not None


def dbo_yield() -> None:
    """Give the turn to the next unfinished micro-batch and wait for it to come back; a no-op
    outside ``run_ubatches`` or when every other micro-batch has finished."""
    ctx: UBatchContext | None = getattr(_local, "ctx", None)
    if ctx is not None and ctx.turn.pass_turn(ctx.id):
        ctx.turn.wait_turn(ctx.id)


@dataclass(frozen=True)
class _ThreadModes:
    """The caller thread's torch modes, re-entered in each micro-batch thread."""

    grad: bool
    inference: bool
    cuda_stream: Any  # torch.cuda.Stream, or None when CUDA is not in use

    @classmethod
    def capture(cls) -> _ThreadModes:
        stream = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            stream = torch.cuda.current_stream()
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), stream)

    @contextmanager
    def entered(self) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad))
            if self.inference:  # inference_mode(False) would turn grad back on
                stack.enter_context(torch.inference_mode())
            if self.cuda_stream is not None:
                stack.enter_context(torch.cuda.device(self.cuda_stream.device))
                stack.enter_context(torch.cuda.stream(self.cuda_stream))
            yield


def _ubatch_main(
    ctx: UBatchContext, fn: Callable[[], Any], modes: _ThreadModes, results: list[Any]
) -> None:
    """One micro-batch's thread: wait for the first turn, run, hand the turn on."""
    _local.ctx = ctx
    error: BaseException | None = None
    try:
        ctx.turn.wait_turn(ctx.id)
        with modes.entered():
            results[ctx.id] = fn()
    except BaseException as exc:  # handed to the caller by run_ubatches
        error = exc
    finally:
        _local.ctx = None
        ctx.turn.finish(ctx.id, error)


def run_ubatches(fns: Sequence[Callable[[], T]]) -> list[T]:
    """Run each function in its own thread in strict ping-pong (micro-batch i = ``fns[i]``,
    starting with 0); their results in order, or the first micro-batch's exception."""
    if dbo_enabled():
        raise RuntimeError("run_ubatches called from inside a micro-batch")
    turn = _PingPong(len(fns))
    modes = _ThreadModes.capture()
    results: list[Any] = [None] * len(fns)
    threads = [
        threading.Thread(
            target=_ubatch_main,
            args=(UBatchContext(i, turn), fn, modes, results),
            name=f"ubatch-{i}",
            daemon=True,
        )
        for i, fn in enumerate(fns)
    ]
    for thread in threads:
        thread.start()
    if threads:
        turn.events[0].set()
    for thread in threads:
        thread.join()
    if turn.failed is not None:
        raise turn.failed
    return results
