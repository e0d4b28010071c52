"""OpenAI's Responses API shapes: the request of ``POST /v1/responses``, the response object
(its output items: messages, function calls, reasoning), and the typed events of a stream.

Input items are read loosely as dicts (``gateway.responses`` turns them into chat messages);
everything shoal writes is typed.
"""

from __future__ import annotations

from typing import Any

import msgspec


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str  # text | json_schema | json_object
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextOptions(msgspec.Struct, kw_only=True):
    format: TextFormat = msgspec.field(default_factory=lambda: TextFormat(type="text"))


class FunctionTool(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    ignore_eos: bool = False  # vLLM's extension (benchmarks: every request its max tokens)
    # as on chat completions (a regex, choice, grammar...): instead of text.format
    structured_outputs: dict[str, Any] | None = None


# ----- the response


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


class MessageItem(msgspec.Struct, tag="message", tag_field="type"):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type"):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # tokens written with an explicit cache retention (OpenAI's extended caching): shoal's
    # prefix cache keeps every full block without being asked, so none are
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct):
    reason: str


class Response(msgspec.Struct, tag="response", tag_field="object", kw_only=True):
    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = msgspec.field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: TextOptions = msgspec.field(default_factory=TextOptions)
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
