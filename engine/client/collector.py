"""Hands one request's outputs from the output handler to the consumer of ``generate()``.

A single slot plus an ``asyncio.Event``: the producer never waits. When outputs pile up before
the consumer reads them they are merged into the slot: in DELTA mode the texts, token ids and
logprobs of each completion are concatenated; otherwise the newer completion replaces the older
one of the same index. An exception put in the slot replaces whatever was there and is raised by
the next ``get``.
"""

from __future__ import annotations

import asyncio

from shoal.bus.messages.sampling import OutputKind
from shoal.engine.client.outputs import CompletionOutput, RequestOutput


class RequestOutputCollector:
    """One request's mailbox between the output handler and ``generate()``."""

    def __init__(self, output_kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        self.aggregate = output_kind == OutputKind.DELTA
        self._slot: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Deliver an output or an error; never blocks."""
        if self._slot is None or isinstance(item, BaseException):
            self._slot = item
        elif isinstance(self._slot, RequestOutput):
            merge_request_output(self._slot, item, self.aggregate)
        # else: an exception is pending; later outputs are dropped behind it.
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next (possibly merged) output; raises the exception delivered instead."""
        while self._slot is None:
            await self._ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        """The pending output, or None; raises a pending exception."""
        return None if self._slot is None else self._take()

    def _take(self) -> RequestOutput:
        item = self._slot
        self._slot = None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item


def merge_request_output(into: RequestOutput, newer: RequestOutput, aggregate: bool) -> None:
    """Fold ``newer`` into ``into`` in place (``aggregate``: DELTA concatenation)."""
    into.finished |= newer.finished
    into.metrics = newer.metrics
    into.num_cached_tokens = newer.num_cached_tokens
    into.error = newer.error if newer.error is not None else into.error
    if newer.prompt_logprobs is not None:
        into.prompt_logprobs = newer.prompt_logprobs
    by_index = {c.index: i for i, c in enumerate(into.outputs)}
    for completion in newer.outputs:
        position = by_index.get(completion.index)
        if position is None:
            by_index[completion.index] = len(into.outputs)
            into.outputs.append(completion)
        elif aggregate:
            _concat_completion(into.outputs[position], completion)
        else:
            into.outputs[position] = completion
    into.outputs.sort(key=lambda c: c.index)


def _concat_completion(into: CompletionOutput, newer: CompletionOutput) -> None:
    into.text += newer.text
    into.token_ids = [*into.token_ids, *newer.token_ids]
    if newer.logprobs is not None:
        into.logprobs = [*(into.logprobs or []), *newer.logprobs]
    into.cumulative_logprob = newer.cumulative_logprob
    into.finish_reason = newer.finish_reason
    into.stop_reason = newer.stop_reason
