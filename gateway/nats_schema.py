"""Wire schema of the gateway's public NATS API (``docs/nats-api.md`` describes it).

A request is one ``GenerateRequest``; the answer is tagged by ``type``: one ``result`` (not
streamed), or ``chunk`` messages then one ``final`` (streamed), or one ``error``. Every message is
encoded like the request: JSON or msgpack.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.bus.messages.sampling import SamplingParams
from shoal.gateway.errors import ErrorInfo
from shoal.gateway.request_types import ChatMessage, TokenId
from shoal.gateway.response_types import Usage

JSON_CONTENT_TYPE = "application/json"


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Exactly one of ``prompt`` (text), ``prompt_token_ids`` or ``messages`` (chat template).

    ``sampling_params`` takes vLLM's names and defaults (``max_tokens`` 16; None: all the room
    left in the context), a field left out taking the model's generation config where it has
    one; its ``output_kind`` is ignored (chunks are always deltas). ``add_special_tokens``
    (None: vLLM's default, true for ``prompt``, false for ``messages``) says whether text is
    tokenized with the tokenizer's special tokens (BOS). With ``messages``, the chat-template
    fields are those of the HTTP API's chat completions.
    """

    prompt: str | None = None
    prompt_token_ids: list[TokenId] | None = None
    messages: list[ChatMessage] | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    request_id: str | None = None
    model: str | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None


class GivenSamplingFields(msgspec.Struct):
    """The ``sampling_params`` fields a request names (decoded beside ``GenerateRequest``):
    the ones it leaves out take the generation config's defaults."""

    sampling_params: dict[str, Any] = {}


class ChoiceOut(msgspec.Struct, omit_defaults=True):
    """One completion: whole (``result``) or what is new since the last chunk (``chunk``).

    ``logprobs[i]`` maps token id → logprob for the i-th token: the sampled one and the top
    alternatives (only when ``sampling_params.logprobs`` is set).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None


class ChoiceEnd(msgspec.Struct, omit_defaults=True):
    index: int
    num_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class GenerateResult(msgspec.Struct, tag="result", tag_field="type"):
    request_id: str
    model: str
    choices: list[ChoiceOut]
    usage: Usage


class GenerateChunk(msgspec.Struct, tag="chunk", tag_field="type"):
    request_id: str
    choices: list[ChoiceOut]


class GenerateFinal(msgspec.Struct, tag="final", tag_field="type"):
    request_id: str
    model: str
    choices: list[ChoiceEnd]
    usage: Usage


class GenerateError(msgspec.Struct, tag="error", tag_field="type"):
    """``status`` is the HTTP status the same error gets on the HTTP API."""

    error: ErrorInfo
    status: int
    request_id: str | None = None
