"""Tool calls in OpenAI's shapes: ``ToolCall`` (a message's ``tool_calls`` entry: ``id``,
``type: "function"``, ``function: {name, arguments}``, the arguments a JSON string),
``DeltaToolCall`` (a stream chunk's entry: the first of a call carries ``index``, ``id``,
``type`` and the name, later ones argument fragments), and what a parser returns."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import msgspec


def new_tool_call_id() -> str:
    """vLLM's id for a tool call: ``chatcmpl-tool-<32 hex digits>``."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON text


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


def opening_delta(index: int, name: str, call_id: str | None = None) -> DeltaToolCall:
    """The first delta of a call: its index, id, type and name (no arguments yet)."""
    return DeltaToolCall(
        index,
        call_id or new_tool_call_id(),
        "function",
        DeltaFunctionCall(name=name, arguments=""),
    )


def arguments_delta(index: int, fragment: str) -> DeltaToolCall:
    return DeltaToolCall(index, function=DeltaFunctionCall(arguments=fragment))


@dataclass(slots=True)
class ExtractedToolCalls:
    """A whole text split into the content before the calls (None: none) and the calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.tool_calls)


@dataclass(slots=True)
class StreamDelta:
    """What one piece of streamed text adds: content and tool-call deltas (either may be
    empty)."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def extend(self, other: StreamDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def join_deltas(deltas: list[DeltaToolCall]) -> list[ToolCall]:
    """The calls that a stream of deltas describes (names and ids from the first delta of each
    index, arguments joined)."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        function = delta.function or DeltaFunctionCall()
        call = calls.get(delta.index)
        if call is None:
            call = ToolCall(delta.id or "", FunctionCall(function.name or "", ""))
            calls[delta.index] = call
        call.function.arguments += function.arguments or ""
    return [calls[i] for i in sorted(calls)]
