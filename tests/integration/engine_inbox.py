"""What an engine core was asked to run: every ``AddRequest`` published to its inbox, read by a
second subscriber. The tests that must see the prompt and sampling parameters the engine got
(not what the gateway answered) read them here."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from shoal.bus.codec import Codec
from shoal.bus.messages.engine import AddRequest, EngineInbound
from shoal.bus.msg import Msg
from shoal.engine.client.engine_client import AsyncEngineClient

_INBOUND: Codec[EngineInbound] = Codec(EngineInbound)


class EngineInbox:
    def __init__(self) -> None:
        self.adds: list[AddRequest] = []

    async def on_message(self, msg: Msg) -> None:
        message = _INBOUND.decode(msg.data)
        if isinstance(message, AddRequest):
            self.adds.append(message)

    @property
    def last(self) -> AddRequest:
        assert self.adds, "the engine core got no request"
        return self.adds[-1]


@contextlib.asynccontextmanager
async def engine_inbox(client: AsyncEngineClient, engine_id: str) -> AsyncIterator[EngineInbox]:
    """The adds ``client`` sends to engine core ``engine_id`` while the context is open."""
    inbox = EngineInbox()
    subscription = await client.bus.subscribe(
        client.subjects.engine_in(engine_id), inbox.on_message
    )
    await client.bus.flush()
    try:
        yield inbox
    finally:
        await subscription.unsubscribe()
