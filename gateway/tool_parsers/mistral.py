"""Mistral tool calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (the pre-v11
form: one JSON array after the tag; content before the tag stays content). ``[TOOL_CALLS]`` is a
special token, so the request keeps special tokens in its text, as vLLM's parser asks."""

from __future__ import annotations

from shoal.gateway.tool_parsers.calls import ExtractedToolCalls
from shoal.gateway.tool_parsers.stream import BLANK, CallFormat, ToolCallStream, extract_calls

MISTRAL = CallFormat(
    start_tag="[TOOL_CALLS]",
    opening=(BLANK, "[", BLANK),
    between=(BLANK, ",", BLANK),
    skip_special_tokens=False,
)


def extract(text: str) -> ExtractedToolCalls:
    return extract_calls(MISTRAL, text)


def stream() -> ToolCallStream:
    return ToolCallStream(MISTRAL)
