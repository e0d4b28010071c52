"""The pure part of the NATS API: a decoded ``GenerateRequest`` checked and turned into a prompt
and sampling parameters (the fields it leaves out from the generation config), the wire format
of a message, and the reply builders."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from shoal.bus.messages.sampling import OutputKind, SamplingParams
from shoal.bus.msg import Msg
from shoal.engine.client.interface import EngineClientInterface
from shoal.engine.client.outputs import CompletionOutput
from shoal.gateway.chat_prompt import chat_options, render_chat
from shoal.gateway.errors import bad_request, from_decode_error, from_value_error
from shoal.gateway.nats_schema import ChoiceEnd, ChoiceOut, GenerateRequest, GivenSamplingFields
from shoal.gateway.params import (
    Prompt,
    check_vocab,
    check_wire_ints,
    resolve_max_tokens,
    text_prompt,
    token_prompt,
)
from shoal.gateway.request_types import MAX_N, decode_json_body
from shoal.gateway.response_types import Usage, make_usage

# Lax, as the HTTP API decodes: 14.0 is the integer 14 (see gateway.request_types).
_JSON_DECODER = msgspec.json.Decoder(GenerateRequest, strict=False)
_MSGPACK_DECODER = msgspec.msgpack.Decoder(GenerateRequest, strict=False)
_JSON_GIVEN = msgspec.json.Decoder(GivenSamplingFields)
_MSGPACK_GIVEN = msgspec.msgpack.Decoder(GivenSamplingFields)


T = TypeVar("T")


class WireFormat:
    """JSON or msgpack, as the request came: a ``Content-Type`` header says, else a payload that
    starts with ``{`` is JSON. Replies use the same format."""

    def __init__(self, is_json: bool) -> None:
        self.is_json = is_json

    @staticmethod
    def of(msg: Msg) -> WireFormat:
        content_type = (msg.header("Content-Type") or "").lower()
        if content_type:
            return WireFormat("json" in content_type)
        return WireFormat(msg.data.lstrip()[:1] == b"{")

    def encode(self, reply: Any) -> bytes:
        return msgspec.json.encode(reply) if self.is_json else msgspec.msgpack.encode(reply)

    def decode_request(self, data: bytes) -> GenerateRequest:
        decoder = _JSON_DECODER if self.is_json else _MSGPACK_DECODER
        try:
            return decoder.decode(data)
        except msgspec.DecodeError as error:
            raise from_decode_error(error, "json" if self.is_json else "msgpack") from None

    def decode_as(self, data: bytes, body_type: type[T]) -> T:
        """Another operation's body (``/v1/embeddings``'), laxly as the HTTP API reads it."""
        try:
            if self.is_json:
                return decode_json_body(data, body_type)
            return msgspec.msgpack.decode(data, type=body_type, strict=False)
        except msgspec.DecodeError as error:
            raise from_decode_error(error, "json" if self.is_json else "msgpack") from None

    def given_sampling_fields(self, data: bytes) -> frozenset[str]:
        """The ``sampling_params`` fields named in ``data`` (a request that decoded)."""
        decoder = _JSON_GIVEN if self.is_json else _MSGPACK_GIVEN
        return frozenset(decoder.decode(data).sampling_params)


def request_prompt(
    request: GenerateRequest, engine: EngineClientInterface, trust_request_chat_template: bool
) -> Prompt:
    """The one prompt of a request: text, token ids, or chat messages through the template."""
    sources = (request.prompt, request.prompt_token_ids, request.messages)
    if sum(source is not None for source in sources) != 1:
        raise bad_request(
            "give exactly one of prompt, prompt_token_ids and messages", param="prompt"
        )
    special = request.add_special_tokens
    if request.prompt is not None:
        add_special = True if special is None else special
        return text_prompt(request.prompt, engine.tokenizer, engine.max_model_len, add_special)
    if request.prompt_token_ids is not None:
        return token_prompt(request.prompt_token_ids, engine.vocabulary)
    assert request.messages is not None
    options = chat_options(request, trust_request_chat_template=trust_request_chat_template)
    return render_chat(engine, request.messages, options, add_special_tokens=bool(special))


def request_params(
    request: GenerateRequest,
    prompt: Prompt,
    engine: EngineClientInterface,
    given_fields: frozenset[str],
) -> SamplingParams:
    """The request's sampling parameters, the fields it leaves out (``given_fields`` are the
    ones it names) from the generation config, with max_tokens fitted to the context, as DELTA
    (and a top_k covering the model's whole vocabulary turned off)."""
    named = msgspec.structs.asdict(request.sampling_params)
    defaults = engine.generation_defaults
    unnamed = {key: value for key, value in defaults.sampling.items() if key not in given_fields}
    given = {**named, **unnamed}
    if given["n"] > MAX_N:  # as on the HTTP API: one message must not fan out without bound
        raise bad_request(f"n must be at most {MAX_N}, got {given['n']}", param="n")
    vocab_size = engine.vocabulary.model_vocab_size
    if given["top_k"] >= vocab_size:
        given["top_k"] = 0
    given["max_tokens"] = resolve_max_tokens(
        given["max_tokens"],
        len(prompt.token_ids),
        engine.max_model_len,
        "sampling_params.max_tokens",
        defaults=defaults,
    )
    given["output_kind"] = OutputKind.DELTA
    try:
        params = SamplingParams(**given)
    except ValueError as error:
        raise from_value_error(error) from None
    check_vocab(params, vocab_size)
    return check_wire_ints(params)


def choice_delta(completion: CompletionOutput, with_logprobs: bool) -> ChoiceOut:
    logprobs = None
    if with_logprobs:
        positions = completion.logprobs or [{} for _ in completion.token_ids]
        logprobs = [{tid: lp.logprob for tid, lp in p.items()} for p in positions]
    return ChoiceOut(
        completion.index,
        completion.text,
        list(completion.token_ids),
        completion.finish_reason,
        completion.stop_reason,
        logprobs,
    )


class ReplyBuilder:
    """Accumulates a request's DELTA outputs into whole choices and usage."""

    def __init__(self, n: int, num_prompt_tokens: int, with_logprobs: bool) -> None:
        self.choices = [ChoiceOut(i, "", []) for i in range(n)]
        if with_logprobs:
            for choice in self.choices:
                choice.logprobs = []
        self.num_prompt_tokens = num_prompt_tokens
        self.with_logprobs = with_logprobs

    def add(self, completion: CompletionOutput) -> ChoiceOut:
        """Fold in one delta; returns the delta as a chunk choice."""
        delta = choice_delta(completion, self.with_logprobs)
        choice = self.choices[completion.index]
        choice.text += delta.text
        choice.token_ids.extend(delta.token_ids)
        if choice.logprobs is not None and delta.logprobs is not None:
            choice.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        return delta

    def usage(self) -> Usage:
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        return make_usage(self.num_prompt_tokens, completion_tokens)

    def ends(self) -> list[ChoiceEnd]:
        return [
            ChoiceEnd(c.index, len(c.token_ids), c.finish_reason, c.stop_reason)
            for c in self.choices
        ]
