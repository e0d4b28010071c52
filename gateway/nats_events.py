"""How the NATS API answers on a request's reply subject: a stream of events (the Responses and
Messages operations' ``stream: true``), each event its own message with the bus's streamed-reply
headers, and the error message that ends any exchange."""

from __future__ import annotations

import logging
from typing import Any

from shoal.bus.base import ERROR_CODE_HEADER, STREAM_ERROR, STREAM_HEADER, ReplyStream
from shoal.bus.msg import Msg
from shoal.gateway.errors import ApiError
from shoal.gateway.events import EventStream
from shoal.gateway.nats_replies import WireFormat
from shoal.gateway.nats_schema import JSON_CONTENT_TYPE, GenerateError

log = logging.getLogger(__name__)


async def reply_error(msg: Msg, wire: WireFormat, error: ApiError, request_id: str) -> None:
    """The ``error`` message (headers ``Shoal-Stream: error``, ``Shoal-Error: <code>``) that
    ends an exchange, encoded as the request was."""
    reply = GenerateError(error.to_response().error, error.status, request_id)
    headers = {STREAM_HEADER: STREAM_ERROR, ERROR_CODE_HEADER: error.code or "error"}
    if wire.is_json:
        headers["Content-Type"] = JSON_CONTENT_TYPE
    try:
        await msg.respond(wire.encode(reply), headers=headers)
    except Exception:  # the caller may be gone: nothing left to tell
        log.debug("could not deliver the error reply of %s", request_id, exc_info=True)


class NatsEventStream(EventStream):
    """Events as reply messages: each event one message (``Shoal-Stream: more``), the stream's
    closing event ``Shoal-Stream: last``; an error part-way is the error message, which ends
    the exchange as it does for generate. A stream never idles out here (no keep-alive)."""

    def __init__(self, msg: Msg, wire: WireFormat, request_id: str) -> None:
        self._msg = msg
        self._wire = wire
        self._request_id = request_id
        self._reply = ReplyStream(msg)
        self._buffer: list[bytes] = []
        self._opened = False

    @property
    def is_open(self) -> bool:
        return self._opened

    async def open(self) -> None:
        self._opened = True

    async def keep_alive(self) -> None:
        return None

    def add(self, event: Any) -> None:
        self._buffer.append(self._wire.encode(event))

    async def flush(self) -> None:
        for data in self._buffer:
            await self._reply.send(data)
        self._buffer.clear()

    async def send_error(self, error: ApiError) -> None:
        self._buffer.clear()
        self._reply.closed = True
        await reply_error(self._msg, self._wire, error, self._request_id)

    async def finish(self) -> None:
        if self._reply.closed:
            return
        last = self._buffer.pop() if self._buffer else None
        await self.flush()
        await self._reply.end(last)
