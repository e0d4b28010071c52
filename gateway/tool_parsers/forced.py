"""``tool_choice`` ``required`` and a named function, as vLLM enforces them: the output is
constrained by a JSON schema, so it needs no model-specific parser. ``required``: an array of
one or more ``{"name": <a tool's name>, "parameters": <that tool's parameters>}`` (one
``anyOf`` branch per tool), parsed by the ``REQUIRED`` format; named: the function's parameters
object itself, which is the call's arguments as they are."""

from __future__ import annotations

from typing import Any

from shoal.gateway.tool_parsers.calls import (
    ExtractedToolCalls,
    FunctionCall,
    StreamDelta,
    ToolCall,
    arguments_delta,
    new_tool_call_id,
    opening_delta,
)
from shoal.gateway.tool_parsers.stream import BLANK, CallFormat

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

REQUIRED = CallFormat(
    start_tag=None,
    opening=(BLANK, "[", BLANK),
    between=(BLANK, ",", BLANK),
    argument_keys=("parameters",),
)


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool's parameters schema (a function without one takes an empty object)."""
    return parameters if parameters is not None else EMPTY_PARAMETERS


def required_schema(
    tools: list[tuple[str, dict[str, Any] | None]], parallel: bool = True
) -> dict[str, Any]:
    """The schema of ``required``'s output for ``(name, parameters)`` of each tool; one call
    at most unless ``parallel`` (OpenAI's ``parallel_tool_calls``)."""
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": parameters_schema(parameters),
            },
            "required": ["name", "parameters"],
        }
        for name, parameters in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def extract_named(name: str, text: str) -> ExtractedToolCalls:
    """A named call's whole output: the arguments of one call to ``name``."""
    return ExtractedToolCalls(None, [ToolCall(new_tool_call_id(), FunctionCall(name, text))])


class NamedCallStream:
    """A named call streamed: its opening delta first, then the text as argument fragments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.called = False

    def feed(self, text: str) -> StreamDelta:
        delta = StreamDelta()
        if not self.called:
            self.called = True
            delta.tool_calls.append(opening_delta(0, self.name))
        if text:
            delta.tool_calls.append(arguments_delta(0, text))
        return delta

    def finish(self) -> StreamDelta:
        return self.feed("") if not self.called else StreamDelta()
