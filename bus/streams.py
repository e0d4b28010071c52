"""The caller's side of streamed replies (``request_stream``; the responder's is
``bus.base.ReplyStream``), written once over the plain ``Bus`` primitives so both transports
share it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from shoal.bus.base import ERROR_CODE_HEADER, STREAM_END, STREAM_ERROR, STREAM_HEADER, STREAM_MORE
from shoal.bus.codec import Codec, DecodeError
from shoal.bus.errors import BusTimeoutError, NoRespondersError, RemoteError
from shoal.bus.messages.control import ErrorReply
from shoal.bus.msg import Msg

if TYPE_CHECKING:
    from shoal.bus.base import Bus

STATUS_HEADER = "Status"
NO_RESPONDERS_STATUS = "503"
_ERROR_CODEC: Codec[ErrorReply] = Codec(ErrorReply)


def error_from_reply(msg: Msg) -> RemoteError:
    """The ``RemoteError`` an ``ErrorReply`` (flagged by its error-code header) stands for."""
    code = msg.header(ERROR_CODE_HEADER) or "error"
    try:
        reply = _ERROR_CODEC.decode(msg.data)
    except DecodeError:
        return RemoteError(code, msg.data.decode(errors="replace"))
    return RemoteError(reply.code, reply.message)


def is_no_responders(msg: Msg) -> bool:
    return msg.header(STATUS_HEADER) == NO_RESPONDERS_STATUS and not msg.data


async def request_stream(
    bus: Bus,
    subject: str,
    data: bytes,
    *,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> AsyncIterator[Msg]:
    """Send a request on ``bus`` and yield its streamed reply messages in order.

    ``timeout`` bounds the wait for *each* next message (the first one included). The final
    message is yielded too when it carries data (``ReplyStream.end(data)``). Raises
    ``RemoteError`` when the responder sends an error, ``NoRespondersError`` or
    ``BusTimeoutError`` as ``Bus.request`` does.
    """
    inbox = bus.new_inbox()
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def collect(msg: Msg) -> None:
        queue.put_nowait(msg)

    sub = await bus.subscribe(inbox, collect, sequential=True)
    try:
        await bus.publish(subject, data, reply=inbox, headers=headers)
        while True:
            try:
                msg = await asyncio.wait_for(queue.get(), timeout)
            except TimeoutError:
                reason = f"no streamed reply on {subject!r} within {timeout}s"
                raise BusTimeoutError(reason) from None
            kind = msg.header(STREAM_HEADER)
            if kind is None and is_no_responders(msg):
                raise NoRespondersError(f"no responders on {subject!r}")
            if kind is None and msg.header(ERROR_CODE_HEADER):
                raise error_from_reply(msg)
            if kind == STREAM_ERROR:
                code = msg.header(ERROR_CODE_HEADER) or "error"
                raise RemoteError(code, msg.data.decode(errors="replace"))
            if kind == STREAM_END:
                return
            yield msg
            if kind != STREAM_MORE:  # the last chunk, or a plain single reply
                return
    finally:
        await sub.unsubscribe()
