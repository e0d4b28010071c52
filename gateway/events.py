"""Streamed answers, whatever carries them: ``EventStream`` is what a streaming handler writes
its events to, ``write_stream`` drives one from a generation's outputs, and the HTTP carriers
are server-sent events: OpenAI's ``data:`` lines (``SseEventStream``) and the named events of
the Responses and Anthropic Messages APIs (``NamedSseStream``). The NATS API's carrier is
``gateway.nats_events``.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from aiohttp import web

from shoal.engine.client.outputs import RequestOutput
from shoal.gateway.errors import ApiError, internal_error
from shoal.gateway.generation import Generation

KEEP_ALIVE_EVENT = b": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see traffic
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class EventStream(abc.ABC):
    """Where a streamed answer's events go. ``add`` buffers an event and ``flush`` sends the
    buffer, so outputs that piled up while the caller was served leave together. ``idle_s``:
    how long a stream may wait for output before ``keep_alive`` (None: never)."""

    idle_s: float | None = None

    @property
    @abc.abstractmethod
    def is_open(self) -> bool:
        """Whether the answer has begun (an error is then an event of the stream)."""

    @abc.abstractmethod
    async def open(self) -> None:
        """Begin the answer (before the first event)."""

    @abc.abstractmethod
    async def keep_alive(self) -> None:
        """Tell the caller the stream still lives while no output comes."""

    @abc.abstractmethod
    def add(self, event: Any) -> None: ...

    @abc.abstractmethod
    async def flush(self) -> None: ...

    @abc.abstractmethod
    async def send_error(self, error: ApiError) -> None:
        """End the stream with ``error`` (after it has opened)."""

    @abc.abstractmethod
    async def finish(self) -> None:
        """End the stream after its last event."""


AddEvents = Callable[[EventStream], None]
AddOutputEvents = Callable[[EventStream, int, RequestOutput], None]


async def write_stream(
    events: EventStream,
    generation: Generation,
    add_output: AddOutputEvents,
    *,
    add_opening: AddEvents | None = None,
    add_closing: AddEvents | None = None,
) -> None:
    """Stream a generation: ``add_opening`` events, then ``add_output(events, prompt_index,
    output)`` per engine output, sent whenever no more outputs wait (the first at once), then
    ``add_closing`` events and ``finish``. An error before the stream opened is raised (the
    caller answers it in its own way); a later one ends the stream as ``send_error`` says. A
    caller that went away ends the stream quietly."""
    outputs = generation.outputs(events.idle_s, events.keep_alive)
    async with contextlib.aclosing(outputs):
        try:
            await _write_events(events, generation, outputs, add_output, add_opening, add_closing)
        except ApiError as error:
            if not events.is_open:
                raise
            await events.send_error(error)
        except ConnectionResetError:
            if not events.is_open:
                raise
            return
        except Exception as error:  # a bug: tell the caller, keep serving others
            if not events.is_open:
                raise
            await events.send_error(internal_error(error))
        await events.finish()


async def _write_events(
    events: EventStream,
    generation: Generation,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    add_output: AddOutputEvents,
    add_opening: AddEvents | None,
    add_closing: AddEvents | None,
) -> None:
    first = await anext(outputs, None)
    await events.open()
    if add_opening is not None:
        add_opening(events)
    if first is not None:
        add_output(events, *first)
    await events.flush()
    async for prompt_index, output in outputs:
        add_output(events, prompt_index, output)
        if not generation.has_pending():
            await events.flush()
    if add_closing is not None:
        add_closing(events)


class SseEventStream(EventStream):
    """OpenAI's server-sent events: ``data: <json>`` per event, then ``data: [DONE]``; a
    keep-alive is a comment line."""

    def __init__(self, request: web.Request, idle_s: float | None = None) -> None:
        self._request = request
        self._buffer: list[bytes] = []
        self.response = web.StreamResponse(headers=SSE_HEADERS)
        self.idle_s = idle_s

    @property
    def is_open(self) -> bool:
        """Whether the 200 and its headers have gone out."""
        return self.response.prepared

    async def open(self) -> None:
        if not self.response.prepared:
            await self.response.prepare(self._request)

    async def keep_alive(self) -> None:
        """A comment line, so proxies do not cut a stream that waits; opens the stream first."""
        await self.open()
        self._buffer.append(KEEP_ALIVE_EVENT)
        await self.flush()

    def add(self, event: Any) -> None:
        self._buffer.append(b"data: " + msgspec.json.encode(event) + b"\n\n")

    async def flush(self) -> None:
        if self._buffer:
            data = b"".join(self._buffer)
            self._buffer.clear()
            await self.response.write(data)

    async def send_error(self, error: ApiError) -> None:
        self._buffer.append(b"data: " + error.to_json() + b"\n\n")
        await self.flush()

    async def finish(self) -> None:
        self._buffer.append(b"data: [DONE]\n\n")
        await self.flush()
        await self.response.write_eof()


def event_type(event: Any) -> str:
    """A named event's type: a dict's ``type``, or a tagged struct's tag."""
    if isinstance(event, dict):
        return str(event["type"])
    return str(type(event).__struct_config__.tag)


class NamedSseStream(SseEventStream):
    """Server-sent events named by their type (``event: <type>`` before each ``data:``), with
    no ``[DONE]``: the Responses and Anthropic Messages APIs' streams. ``error_event`` is the
    API's error event."""

    def add(self, event: Any) -> None:
        data = msgspec.json.encode(event)
        self._buffer.append(f"event: {event_type(event)}\n".encode() + b"data: " + data + b"\n\n")

    @abc.abstractmethod
    def error_event(self, error: ApiError) -> Any:
        """The API's error event."""

    async def send_error(self, error: ApiError) -> None:
        self.add(self.error_event(error))
        await self.flush()

    async def finish(self) -> None:
        await self.flush()
        await self.response.write_eof()
