"""Run one engine request per prompt and merge their outputs as they arrive.

``Generation`` is shared by the HTTP endpoints and the NATS API. It maps engine errors to
``ApiError`` (400/503), feeds the metrics, and on ``close`` (normal end, client gone, or error)
settles the metrics at once, then closes every engine iterator still open, which aborts those
requests in their engine cores, in a task that a second cancellation cannot interrupt. A reader
may ask to be called back while no output comes (the SSE keep-alive).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.sampling import SamplingParams
from shoal.engine.client.interface import (
    EngineClientInterface,
    EngineUnavailableError,
    RequestValidationError,
)
from shoal.engine.client.outputs import RequestOutput
from shoal.gateway.errors import ApiError, bad_request, unavailable
from shoal.gateway.metrics import Metrics, RequestTimer
from shoal.gateway.params import Prompt

log = logging.getLogger(__name__)

_DONE = object()
OnIdle = Callable[[], Awaitable[None]]
_CLOSING: set[asyncio.Task[None]] = set()  # aborts under way, referenced until they end


def engine_error(error: BaseException) -> ApiError:
    """An exception from the engine client as the error the caller gets."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, RequestValidationError):
        return bad_request(str(error), param=error.param)
    if isinstance(error, EngineUnavailableError):
        return unavailable(str(error) or "no engine core can take the request")
    log.error("engine request failed", exc_info=error)
    return ApiError(503, f"the engine failed: {type(error).__name__}: {error}", code="engine_error")


class Generation:
    """The engine requests of one API request: ``prompts[i]`` runs as ``{request_id}-{i}``."""

    def __init__(
        self,
        engine: EngineClientInterface,
        prompts: Sequence[Prompt],
        params: Sequence[SamplingParams],
        request_id: str,
        metrics: Metrics | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.engine = engine
        self.lora_request = lora_request  # every prompt's adapter (None: the base model)
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.prompts = list(prompts)
        self.params = list(params)
        self.request_id = request_id
        self.metrics = metrics
        self.timers: list[RequestTimer | None] = [None] * len(self.prompts)
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._num_open = len(self.prompts)
        self._finished: set[int] = set()

    def engine_request_id(self, prompt_index: int) -> str:
        return f"{self.request_id}-{prompt_index}"

    def start(self) -> None:
        for index, prompt in enumerate(self.prompts):
            params = self.params[index]
            if self.metrics is not None:
                self.timers[index] = self.metrics.start_request(
                    num_prompt_tokens=len(prompt.token_ids),
                    n=params.n,
                    max_tokens=params.max_tokens,
                    arrival_time=self.arrival_time,
                )
            task = asyncio.create_task(self._pump(index, prompt, params))
            self._tasks.append(task)

    async def _pump(self, index: int, prompt: Prompt, params: SamplingParams) -> None:
        stream = self.engine.generate(
            prompt.token_ids,
            params,
            self.engine_request_id(index),
            lora_request=self.lora_request,
        )
        try:
            async for output in stream:
                self._queue.put_nowait((index, output))
        except Exception as error:
            self._queue.put_nowait((index, error))
        else:
            self._queue.put_nowait((index, _DONE))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def outputs(
        self, idle_s: float | None = None, on_idle: OnIdle | None = None
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """``(prompt_index, output)`` in arrival order until every prompt has finished;
        ``on_idle`` is awaited each time ``idle_s`` pass without one."""
        while self._num_open:
            index, item = await self._next(idle_s, on_idle)
            if item is _DONE:
                self._num_open -= 1
                continue
            if isinstance(item, BaseException):
                raise engine_error(item)
            self._observe(index, item)
            if item.error is not None and item.finished:
                raise ApiError(503, f"the engine failed: {item.error}", code="engine_error")
            yield index, item

    async def _next(self, idle_s: float | None, on_idle: OnIdle | None) -> tuple[int, Any]:
        if on_idle is None or not idle_s or not self._queue.empty():
            return await self._queue.get()
        while True:
            try:  # a get cut short by the timeout leaves its item in the queue
                return await asyncio.wait_for(self._queue.get(), idle_s)
            except TimeoutError:
                await on_idle()

    def has_pending(self) -> bool:
        """Whether more outputs (or an end) are already waiting to be read."""
        return not self._queue.empty()

    def _observe(self, index: int, output: RequestOutput) -> None:
        if output.finished:
            self._finished.add(index)
        timer = self.timers[index]
        if self.metrics is None or timer is None:
            return
        self.metrics.observe_output(timer, output)
        if output.finished:
            self.metrics.finish_request(timer, self.params[index].n)

    async def close(self) -> None:
        """Settle the metrics, then stop every engine request still running (aborting it).

        The accounting is settled before the first await, and the aborts run in a task of their
        own that a cancellation of the caller (a client hanging up while this waits) does not
        interrupt: neither the in-flight count nor an engine core is left holding the request.
        """
        self._settle_metrics()
        for task in self._tasks:
            task.cancel()
        if not self._tasks:
            return
        closing = asyncio.create_task(self._stop_engine_requests())
        _CLOSING.add(closing)
        closing.add_done_callback(_CLOSING.discard)
        await asyncio.shield(closing)

    def _settle_metrics(self) -> None:
        """Count every request as finished (unfinished completions as aborted); idempotent."""
        if self.metrics is None:
            return
        for index, timer in enumerate(self.timers):
            if timer is not None:
                self.metrics.finish_request(timer, self.params[index].n)

    async def _stop_engine_requests(self) -> None:
        await asyncio.wait(self._tasks)  # unlike gather, a cancelled caller leaves them be
        for index in range(len(self._tasks)):
            if index not in self._finished:  # closing the iterator aborts; this makes sure
                with contextlib.suppress(Exception):
                    await self.engine.abort(self.engine_request_id(index))

    async def __aenter__(self) -> Generation:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
