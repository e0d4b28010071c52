"""The engine core's link to its workers when its bus connection drops and comes back: every
reply still awaited fails with ``WorkerFailure``, and those no wait will ever read (another
rank's, a later step's in flight with async scheduling) are not reported by asyncio as
exceptions never retrieved (an ERROR line in an otherwise clean recovery)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from shoal.bus.messages.worker import ExecuteStep
from shoal.bus.subjects import Subjects
from shoal.bus.transport.memory import InMemoryBus
from shoal.engine.actor.worker_link import WorkerFailure, WorkerLink


async def test_replies_cut_by_a_reconnect_fail_without_unretrieved_exceptions() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    bus = InMemoryBus()
    await bus.connect()
    link = WorkerLink(bus, Subjects("link-reconnect"), "e0", ["w0", "w1"])
    await link.start()
    try:
        first = await link.submit(ExecuteStep(1))
        await link.submit(ExecuteStep(2))  # in flight behind it, never waited for
        bus._reconnected()  # what NatsBus does when its connection is back
        with pytest.raises(WorkerFailure, match="lost mid-step"):
            await link.wait(first)
        assert all(future.done() for future in first.replies)
    finally:
        await link.stop()
        await bus.close()
    del first
    gc.collect()
    await asyncio.sleep(0)
    assert not [c for c in reported if "never retrieved" in c.get("message", "")], reported
