"""Typed request bodies of the OpenAI-compatible API (decoded with msgspec, so a wrong type or an
out-of-range value is a 400 naming the field). Unknown fields are ignored, as OpenAI clients
send extras; unsupported features that change semantics are refused in ``gateway.params``.

Decoding is lax, as vLLM's pydantic models are: ``14.0`` is the integer 14, ``"2"`` the integer
2, ``"true"`` a bool. Every field OpenAI's schema marks nullable takes ``null`` for its default.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec

from shoal.gateway.structured import ResponseFormat

T = TypeVar("T")

MAX_N = 128  # completions per prompt; bounds the work one request may ask for
MAX_PROMPTS = 1024  # prompts in one completions request
MAX_CHOICES = 1024  # prompts × n in one request

PositiveN = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
# A prompt: text, token ids, or a batch of either (checked for homogeneity in gateway.params).
PromptInput = str | list[str | TokenId | list[TokenId]]
StopInput = str | list[str] | None


def decode_json_body(raw: bytes, body_type: type[T]) -> T:
    """A JSON request body as ``body_type``, laxly (raises ``msgspec.DecodeError``)."""
    return msgspec.json.decode(raw, type=body_type, strict=False)


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class CalledFunction(msgspec.Struct):
    name: str
    arguments: str  # a JSON text, as OpenAI sends it back


class MessageToolCall(msgspec.Struct):
    """A call in an assistant message of the conversation."""

    id: str
    function: CalledFunction
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDefinition(msgspec.Struct, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(msgspec.Struct, omit_defaults=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    """``tool_choice`` naming the function to call."""

    function: NamedFunction
    type: Literal["function"] = "function"


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: PositiveN | None = None  # None: 1
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: StopInput = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a string) -> [-100, 100]
    allowed_token_ids: list[TokenId] | None = None  # vLLM's: the only tokens that may be sampled
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's; shoal reads kv_load_tiers
    # Structured outputs (``gateway.structured``): OpenAI's response_format, vLLM's fields.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def num_choices(self) -> int:
        """``n``, 1 when not given."""
        return 1 if self.n is None else self.n


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: PromptInput
    max_tokens: int | None = 16  # None: all the room left; 0 with echo: score the prompt only
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's default for completions (BOS, if the model has one)


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    echo: bool | None = None
    add_special_tokens: bool = False  # vLLM's default for chat: the template supplies any BOS
    # vLLM's chat-template fields (``gateway.chat_prompt``).
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last (assistant) message open
    chat_template: str | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    documents: list[dict[str, str]] | None = None  # for retrieval-augmented templates
    tools: list[ChatTool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # none, auto, required or a function
    parallel_tool_calls: bool | None = None  # False: required makes one call (auto: as written)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``/tokenize``: either ``prompt`` (completion form) or ``messages`` (chat form, rendered
    as chat completions render it)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``/v1/load_lora_adapter`` body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``/v1/unload_lora_adapter`` body (``lora_int_id`` is accepted and unused)."""

    lora_name: str
    lora_int_id: int | None = None
