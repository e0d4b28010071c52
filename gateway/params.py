"""From a decoded request to what the engine takes: prompts as token ids, checked against the
model's vocabulary (vLLM's rule: ``engine.client.vocabulary``), and one ``SamplingParams`` per
prompt, its unset fields from the model's generation config (``--generation-config``). Every
failure is an ``ApiError`` (400)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shoal.bus.messages.sampling import KV_TIER_TYPES, OutputKind, SamplingParams, out_of_vocab
from shoal.engine.client.generation_defaults import GenerationDefaults
from shoal.engine.client.vocabulary import Vocabulary
from shoal.gateway.errors import ApiError, bad_request, from_value_error
from shoal.gateway.request_types import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    PromptInput,
    _SamplingFields,
)
from shoal.gateway.structured import structured_outputs_of

_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass(slots=True)
class Prompt:
    """One prompt as the engine gets it; ``text`` is kept for echo (None for token-id input)."""

    token_ids: list[int]
    text: str | None = None


MAX_CHARS_PER_TOKEN = 64  # no tokenizer averages more; longer text cannot fit the context


def check_text_length(text: str, max_model_len: int | None, param: str) -> None:
    """Refuse, before tokenizing it on the event loop, text far too long to fit the context."""
    if max_model_len is not None and len(text) > max_model_len * MAX_CHARS_PER_TOKEN:
        message = f"{param} has {len(text)} characters, far more than {max_model_len} tokens"
        raise ApiError(400, message, code="context_length_exceeded", param=param)


def completion_prompts(
    prompt: PromptInput,
    tokenizer: Any,
    vocabulary: Vocabulary,
    max_model_len: int | None = None,
    add_special_tokens: bool = True,
) -> list[Prompt]:
    """A completions ``prompt`` (text, ids, or a batch of either) as a list of prompts; text is
    tokenized with or without the tokenizer's special tokens (BOS), ids are taken as they are
    when the model takes them."""
    if isinstance(prompt, str):
        return [text_prompt(prompt, tokenizer, max_model_len, add_special_tokens)]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [token_prompt([int(t) for t in prompt], vocabulary)]  # type: ignore[arg-type]
    if len(prompt) > MAX_PROMPTS:  # a list of ids is one prompt, handled above
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        texts: list[str] = prompt  # type: ignore[assignment]
        return [text_prompt(t, tokenizer, max_model_len, add_special_tokens) for t in texts]
    if all(isinstance(p, list) for p in prompt):
        return [token_prompt(p, vocabulary) for p in prompt]  # type: ignore[arg-type]
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
        "token ids",
        param="prompt",
    )


def text_prompt(
    text: str, tokenizer: Any, max_model_len: int | None = None, add_special_tokens: bool = True
) -> Prompt:
    check_text_length(text, max_model_len, "prompt")
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    if not ids:
        raise bad_request("prompt must not be empty", param="prompt")
    return Prompt(ids, text)


def token_prompt(ids: list[int], vocabulary: Vocabulary) -> Prompt:
    if not ids:
        raise bad_request("prompt must not be empty", param="prompt")
    if invalid := vocabulary.invalid_prompt_id(ids):
        raise bad_request(invalid, param="prompt")
    return Prompt(ids)


NO_GENERATION_DEFAULTS = GenerationDefaults()


def resolve_max_tokens(
    requested: int | None,
    prompt_len: int,
    max_model_len: int,
    param: str,
    *,
    max_tokens_param: str | None = None,
    defaults: GenerationDefaults = NO_GENERATION_DEFAULTS,
) -> int:
    """Tokens the request may generate: all the room left when unset (or the generation
    config's ``max_new_tokens``, when less: ``defaults``). A requested number beyond the room
    is a 400 naming ``max_tokens_param`` (vLLM's and OpenAI's answer), or is fitted to the room
    when that is None (shoal's NATS API)."""
    resolved = _fit_max_tokens(requested, prompt_len, max_model_len, param, max_tokens_param)
    return defaults.bound_max_tokens(requested, resolved)


def _fit_max_tokens(
    requested: int | None,
    prompt_len: int,
    max_model_len: int,
    param: str,
    max_tokens_param: str | None,
) -> int:
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens, leaving no room to generate.",
            code="context_length_exceeded",
            param=param,
        )
    room = max_model_len - prompt_len
    if requested is None or requested <= room:
        return room if requested is None else requested
    if max_tokens_param is None:
        return room
    raise ApiError(
        400,
        f"'{max_tokens_param}' is too large: {requested}. This model's maximum context length "
        f"is {max_model_len} tokens and your request has {prompt_len} input tokens "
        f"({requested} > {max_model_len} - {prompt_len}).",
        code="context_length_exceeded",
        param=max_tokens_param,
    )


def check_unsupported(request: _SamplingFields) -> None:
    for name in _FLOAT_FIELDS:
        value = getattr(request, name)
        if value is not None and not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number", param=name)
    if isinstance(request, CompletionRequest) and request.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if (
        isinstance(request, ChatCompletionRequest)
        and request.top_logprobs is not None
        and not request.logprobs
    ):
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")


MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each bias value


def logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token-id strings to values in [-100, 100]) keyed by int."""
    if raw is None:
        return None
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN fails too
            raise bad_request(
                f"logit_bias values must be in [-100, 100], got {value} for token {key}",
                param="logit_bias",
            )
        bias[token_id] = value
    return bias


def check_vocab(params: SamplingParams, vocab_size: int | None) -> None:
    """A 400 naming the field when logit_bias or allowed_token_ids is out of the vocabulary."""
    if vocab_size is not None and (invalid := out_of_vocab(params, vocab_size)):
        raise bad_request(invalid[1], param=invalid[0])


def kv_load_tiers(params: dict[str, Any] | None) -> list[str] | None:
    """vLLM's ``kv_transfer_params``: shoal reads ``kv_load_tiers`` (a list of tier types the
    request may load its prefix from); any other key is refused by name."""
    if params is None:
        return None
    for key in params:
        if key != "kv_load_tiers":
            raise bad_request(
                f"kv_transfer_params.{key} is not supported (shoal reads kv_load_tiers)",
                param="kv_transfer_params",
            )
    tiers = params.get("kv_load_tiers")
    if tiers is None:
        return None
    if not isinstance(tiers, list) or not all(t in KV_TIER_TYPES for t in tiers):
        raise bad_request(
            f"kv_transfer_params.kv_load_tiers must be a list of tier types of "
            f"{list(KV_TIER_TYPES)}, got {tiers!r}",
            param="kv_transfer_params",
        )
    return tiers


WIRE_INT_MIN, WIRE_INT_MAX = -(2**63), 2**64 - 1  # the integers msgpack carries


def check_wire_ints(params: SamplingParams) -> SamplingParams:
    """Refuse integers the engine's wire format cannot carry: they would fail only when the
    engine client encodes the request (an engine error, 503) instead of as bad input."""
    if params.seed is not None and not WIRE_INT_MIN <= params.seed <= WIRE_INT_MAX:
        raise bad_request(f"seed must be in [{WIRE_INT_MIN}, {WIRE_INT_MAX}]", param="seed")
    if params.stop_token_ids and max(params.stop_token_ids) > WIRE_INT_MAX:
        raise bad_request(f"stop_token_ids must be at most {WIRE_INT_MAX}", param="stop_token_ids")
    return params


def sampling_params(
    request: _SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    output_kind: OutputKind = OutputKind.DELTA,
    rename: dict[str, str] | None = None,
    vocab_size: int | None = None,
    defaults: GenerationDefaults = NO_GENERATION_DEFAULTS,
) -> SamplingParams:
    """The engine's sampling parameters; unset (None) fields take the generation config's
    ``defaults``, else SamplingParams' defaults.

    A ``top_k`` of at least the vocabulary size (the model's) is the same as no top-k: it
    becomes 0 (off).
    """
    optional = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
    }
    kwargs = defaults.under({name: v for name, v in optional.items() if v is not None})
    if vocab_size is not None and kwargs.get("top_k", 0) >= vocab_size:
        kwargs["top_k"] = 0
    kwargs["kv_load_tiers"] = kv_load_tiers(request.kv_transfer_params)
    kwargs["logit_bias"] = logit_bias(request.logit_bias)
    kwargs["allowed_token_ids"] = request.allowed_token_ids
    kwargs["structured_outputs"] = structured_outputs_of(request)
    try:
        params = SamplingParams(
            n=request.num_choices,
            seed=request.seed,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            output_kind=output_kind,
            **kwargs,
        )
    except ValueError as error:
        raise from_value_error(error, rename=rename) from None
    check_vocab(params, vocab_size)
    return check_wire_ints(params)
