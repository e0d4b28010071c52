"""Opening a JetStream stream (a KV bucket's, an object store's, an event stream), creating it
when missing, for ``bus.jetstream.kv_bucket``, ``bus.jetstream.object_store`` and
``bus.jetstream.nats_stream``. With per-role NATS users no actor may create one
(``bus.nats_ops.permissions``: whoever creates a stream picks its subjects); the provisioner does,
through ``shoal nats-init``. A request the server refuses fails at once (nats-py only logs the
refusal and waits for its timeout): creating is ``NotProvisionedError``, anything else
``NotPermittedError``."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from shoal.bus.errors import BusError
from shoal.bus.transport.nats_connected import NatsConnectedBus

T = TypeVar("T")


class NotPermittedError(BusError):
    """This NATS user may not use a bucket or stream."""


class NotProvisionedError(NotPermittedError):
    """A bucket or stream is missing and this user may not create it."""


async def open_guarded(
    bus: NatsConnectedBus, stream: str, what: str, opening: Coroutine[Any, Any, T]
) -> T:
    """Await ``opening``, the requests opening (or creating) JetStream stream ``stream``
    (``what`` names it for people: "key-value bucket 'x'"); its other errors pass through."""
    task = asyncio.ensure_future(opening)
    violation = bus.next_violation()
    try:
        while True:
            pending: set[asyncio.Future[Any]] = {task, violation}
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            refused = violation.result().lower()
            if _names_stream(refused, stream.lower()):
                raise _refusal(bus, what, refused)
            violation = bus.next_violation()  # another request's refusal: keep waiting
    finally:
        task.cancel()
        violation.cancel()


def _names_stream(violation: str, stream: str) -> bool:
    """Whether the server's refusal (``... publish to "$js.api.stream.info.<stream>"``) is of
    a JetStream API request about ``stream`` (names are matched lowercase, as it reports)."""
    _, api, subject = violation.rpartition('"$js.api.')
    return bool(api) and stream in subject.rstrip('"').split(".")


def _refusal(bus: NatsConnectedBus, what: str, refused: str) -> NotPermittedError:
    if "$js.api.stream.create." in refused:
        return NotProvisionedError(
            f"{what} does not exist and NATS user {bus.user!r} may not create it: create the "
            "deployment's buckets and streams first with `shoal nats-init --namespace NS` as "
            "its provisioner user (docs/security.md)"
        )
    return NotPermittedError(f"NATS user {bus.user!r} may not use {what}: {refused}")
