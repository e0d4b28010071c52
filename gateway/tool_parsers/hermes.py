"""Hermes / Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one
tag pair per call, blanks between (an unclosed last tag is accepted, as vLLM does). The tags
are special tokens in Qwen's vocabulary, so the request keeps special tokens in its text."""

from __future__ import annotations

from shoal.gateway.tool_parsers.calls import ExtractedToolCalls
from shoal.gateway.tool_parsers.stream import BLANK, CallFormat, ToolCallStream, extract_calls

HERMES = CallFormat(
    start_tag="<tool_call>",
    opening=(BLANK,),
    between=(BLANK, "</tool_call>", BLANK, "<tool_call>", BLANK),
    skip_special_tokens=False,
)


def extract(text: str) -> ExtractedToolCalls:
    return extract_calls(HERMES, text)


def stream() -> ToolCallStream:
    return ToolCallStream(HERMES)
