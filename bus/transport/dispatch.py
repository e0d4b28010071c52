"""Runs a subscription's handler for each delivered message: one task per message (the default)
or one at a time in arrival order (``sequential``). Keeps a reference to every task, logs handler
failures, and drains on unsubscribe/close. Shared by both transports."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from shoal.bus.msg import Handler, Msg

log = logging.getLogger(__name__)

Resolver = Callable[[Msg], Awaitable[Msg]]


class Dispatcher:
    """Delivers messages of one subscription to its handler; ``resolve`` (optional) turns a
    chunked-payload manifest into the full message before the handler sees it."""

    __slots__ = ("_closed", "_handler", "_queue", "_resolve", "_subject", "_tasks", "_worker")

    def __init__(
        self, subject: str, handler: Handler, *, sequential: bool, resolve: Resolver | None
    ) -> None:
        self._subject = subject
        self._handler = handler
        self._resolve = resolve
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._queue: asyncio.Queue[Msg] | None = None
        self._worker: asyncio.Task[None] | None = None
        if sequential:
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._run_sequential())

    def deliver(self, msg: Msg) -> None:
        if self._closed:
            return
        if self._queue is not None:
            self._queue.put_nowait(msg)
            return
        task = asyncio.get_running_loop().create_task(self._run_one(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_one(self, msg: Msg) -> None:
        try:
            if self._resolve is not None and msg.headers:
                msg = await self._resolve(msg)
            await self._handler(msg)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler for %r failed on %r", self._subject, msg)

    async def _run_sequential(self) -> None:
        assert self._queue is not None
        while True:
            msg = await self._queue.get()
            try:
                await self._run_one(msg)
            finally:
                self._queue.task_done()

    @property
    def num_pending(self) -> int:
        queued = self._queue.qsize() if self._queue is not None else 0
        return queued + len(self._tasks)

    async def drain(self, timeout: float) -> None:
        """Stop taking messages; wait (bounded) for queued and running handlers, then cancel."""
        self._closed = True
        try:
            async with asyncio.timeout(timeout):
                if self._queue is not None:
                    await self._queue.join()
                while self._tasks:
                    await asyncio.wait(list(self._tasks))
        except TimeoutError:
            left = self.num_pending
            log.warning("drain of %r timed out with %d handlers left", self._subject, left)
        self.cancel()

    def cancel(self) -> None:
        self._closed = True
        if self._worker is not None:
            self._worker.cancel()
        for task in list(self._tasks):
            task.cancel()
