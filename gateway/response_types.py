"""Response bodies and stream chunks of the OpenAI-compatible API, in OpenAI's exact shapes.

They follow OpenAI's published OpenAPI schema (tests/fixtures/openai_schema.py states it): an
``object`` constant on every body and chunk (a msgspec tag, so it is sent even where defaults are
omitted), ``refusal`` on chat messages and chat logprobs, and no ``system_fingerprint`` (the
schema wants a string or nothing; shoal has none to give)."""

from __future__ import annotations

import msgspec

from shoal.gateway.tool_parsers.calls import DeltaToolCall, ToolCall


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def make_usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


# --- logprobs -------------------------------------------------------------------------------


class CompletionLogprobs(msgspec.Struct):
    """Completions' logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] = msgspec.field(default_factory=list)
    refusal: list[ChatTokenLogprob] | None = None  # required by the schema; never any here


# --- completions ----------------------------------------------------------------------------


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(
    msgspec.Struct, omit_defaults=True, tag_field="object", tag="text_completion"
):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# --- chat -----------------------------------------------------------------------------------


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str | None
    refusal: str | None = None  # required by the schema (nullable); shoal never refuses
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    reasoning_content: str | None = None  # vLLM's: the thinking (--reasoning-parser)


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(
    msgspec.Struct, omit_defaults=True, tag_field="object", tag="chat.completion"
):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


# --- stream chunks (usage is omitted unless set) --------------------------------------------


class CompletionChunk(
    msgspec.Struct, omit_defaults=True, tag_field="object", tag="text_completion"
):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletionChunk(
    msgspec.Struct, omit_defaults=True, tag_field="object", tag="chat.completion.chunk"
):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# --- models, tokenizer, version -------------------------------------------------------------


class ModelCard(msgspec.Struct, tag_field="object", tag="model"):
    id: str
    created: int
    max_model_len: int
    owned_by: str = "shoal"
    root: str | None = None
    parent: str | None = None


class ModelList(msgspec.Struct, tag_field="object", tag="list"):
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str
