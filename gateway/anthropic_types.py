"""Anthropic's Messages API, as its published schema has it: the request of ``POST
/v1/messages``, the message it answers, the server-sent events of a stream, and the error body.

Decoded laxly as the OpenAI bodies are (``gateway.request_types``): unknown fields are ignored,
a wrong type or a missing required field is a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImageBlock(msgspec.Struct, tag="image", tag_field="type"):
    source: dict[str, Any] | None = None


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type"):
    source: dict[str, Any] | None = None


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str | None = None


InputBlock = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class InputMessage(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[InputBlock]


class Tool(msgspec.Struct):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None


class ToolChoice(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[InputMessage]
    max_tokens: int
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM's extension (benchmarks: every request its max_tokens)
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension: a grammar


class Usage(msgspec.Struct):
    input_tokens: int
    output_tokens: int


class TextOut(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ToolUseOut(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: Any


class ThinkingOut(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""  # Anthropic signs its thinking; shoal has nothing to sign it with


ContentOut = TextOut | ToolUseOut | ThinkingOut


class Message(msgspec.Struct, tag="message", tag_field="type"):
    id: str
    model: str
    content: list[ContentOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"


# ----- the events of a stream, in order: message_start, then per content block a start, its
# deltas and a stop, then message_delta (stop reason, output tokens) and message_stop


class MessageStart(msgspec.Struct, tag="message_start", tag_field="type"):
    message: Message


class ContentBlockStart(msgspec.Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: ContentOut


class TextDelta(msgspec.Struct, tag="text_delta", tag_field="type"):
    text: str


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


class ThinkingDelta(msgspec.Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class ContentBlockDelta(msgspec.Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta


class ContentBlockStop(msgspec.Struct, tag="content_block_stop", tag_field="type"):
    index: int


class StopDelta(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class OutputUsage(msgspec.Struct):
    output_tokens: int


class MessageDelta(msgspec.Struct, tag="message_delta", tag_field="type"):
    delta: StopDelta
    usage: OutputUsage


class MessageStop(msgspec.Struct, tag="message_stop", tag_field="type"):
    pass


class ErrorInfo(msgspec.Struct):
    type: str
    message: str


class ErrorBody(msgspec.Struct, tag="error", tag_field="type"):
    error: ErrorInfo


StreamEvent = (
    MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta
    | MessageStop | ErrorBody
)  # fmt: skip
