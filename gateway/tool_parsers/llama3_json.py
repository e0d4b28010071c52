"""Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}`` (``arguments`` is read too),
several separated by ``;``, either as the whole answer (its first non-blank character a ``{``)
or after ``<|python_tag|>`` (content before the tag stays content). The tag is a special token,
dropped from the text unless the request keeps special tokens; either way the calls parse."""

from __future__ import annotations

from shoal.gateway.tool_parsers.calls import ExtractedToolCalls
from shoal.gateway.tool_parsers.stream import BLANK, CallFormat, ToolCallStream, extract_calls

LLAMA3_JSON = CallFormat(
    start_tag="<|python_tag|>",
    opening=(BLANK,),
    between=(BLANK, ";", BLANK),
    argument_keys=("parameters", "arguments"),
    bare_json_start=True,
)


def extract(text: str) -> ExtractedToolCalls:
    return extract_calls(LLAMA3_JSON, text)


def stream() -> ToolCallStream:
    return ToolCallStream(LLAMA3_JSON)
