"""Request → engine inputs: prompts, max_tokens, sampling parameters and the error each bad
value becomes (status, code, param); the lax decoding (14.0 as an integer, null as the default),
the function role and add_special_tokens."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest

from shoal.bus.messages.sampling import OutputKind
from shoal.bus.messages.structured import StructuredOutputsParams as SOP
from shoal.engine.client.vocabulary import Vocabulary
from shoal.gateway.chat_prompt import chat_messages
from shoal.gateway.errors import ApiError, from_decode_error
from shoal.gateway.params import (
    check_unsupported,
    completion_prompts,
    resolve_max_tokens,
    sampling_params,
)
from shoal.gateway.request_types import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    decode_json_body,
)
from tests.unit.test_gateway_fake import fake_tokenizer


def _decode(body: bytes, kind: type) -> Any:
    try:
        return decode_json_body(body, kind)
    except msgspec.DecodeError as error:
        raise from_decode_error(error) from None


def fake_vocabulary() -> Vocabulary:
    """The fake tokenizer's ids, in a model of as many."""
    return Vocabulary(len(fake_tokenizer()) - 1, len(fake_tokenizer()))


def test_prompt_forms() -> None:
    tok, vocab = fake_tokenizer(), fake_vocabulary()
    ids = tok.encode("the fox")
    assert [p.token_ids for p in completion_prompts("the fox", tok, vocab)] == [ids]
    assert completion_prompts("the fox", tok, vocab)[0].text == "the fox"
    assert [p.token_ids for p in completion_prompts(ids, tok, vocab)] == [ids]
    assert completion_prompts(ids, tok, vocab)[0].text is None
    assert [p.text for p in completion_prompts(["a", "b"], tok, vocab)] == ["a", "b"]
    batch = completion_prompts([ids, ids[:1]], tok, vocab)
    assert [p.token_ids for p in batch] == [ids, ids[:1]]


@pytest.mark.parametrize("prompt", ["", [], [[]], ["a", 1], [[1], "a"], [10**6]])
def test_bad_prompts_name_the_prompt(prompt: object) -> None:
    with pytest.raises(ApiError) as caught:
        completion_prompts(prompt, fake_tokenizer(), fake_vocabulary())  # type: ignore[arg-type]
    assert caught.value.status == 400 and caught.value.param == "prompt"


def test_max_tokens_fits_the_context() -> None:
    assert resolve_max_tokens(None, 10, 64, "prompt") == 54
    assert resolve_max_tokens(16, 10, 64, "prompt") == 16
    assert resolve_max_tokens(54, 10, 64, "prompt", max_tokens_param="max_tokens") == 54
    assert resolve_max_tokens(100, 10, 64, "prompt") == 54  # fitted (the NATS API)
    with pytest.raises(ApiError) as caught:
        resolve_max_tokens(1, 64, 64, "messages")
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"


def test_max_tokens_beyond_the_room_is_refused_as_vllm_does() -> None:
    with pytest.raises(ApiError) as caught:
        resolve_max_tokens(55, 10, 64, "messages", max_tokens_param="max_completion_tokens")
    error = caught.value
    assert error.status == 400 and error.code == "context_length_exceeded"
    assert error.param == "max_completion_tokens"
    assert "'max_completion_tokens' is too large: 55" in error.message
    assert "(55 > 64 - 10)" in error.message


def test_sampling_params_keep_defaults_and_force_delta() -> None:
    body = _decode(b'{"prompt": "x", "temperature": 0, "stop": "!", "seed": 3}', CompletionRequest)
    params = sampling_params(body, max_tokens=5, logprobs=2)  # type: ignore[arg-type]
    assert params.temperature == 0 and params.top_p == 1.0 and params.stop == ["!"]
    assert params.seed == 3 and params.max_tokens == 5 and params.logprobs == 2
    assert params.output_kind == OutputKind.DELTA and params.is_greedy


def test_kv_transfer_params_give_the_load_tiers() -> None:
    body = _decode(b'{"prompt": "x", "kv_transfer_params": {"kv_load_tiers": ["cpu", "obj"]}}',
                   CompletionRequest)  # fmt: skip
    assert sampling_params(body, max_tokens=5, logprobs=None).kv_load_tiers == ["cpu", "obj"]
    plain = _decode(b'{"prompt": "x"}', CompletionRequest)
    assert sampling_params(plain, max_tokens=5, logprobs=None).kv_load_tiers is None


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        (b'{"kv_load_tiers": ["disk"]}', "kv_load_tiers must be a list of tier types"),
        (b'{"kv_load_tiers": "cpu"}', "kv_load_tiers must be a list of tier types"),
        (b'{"do_remote_prefill": true}', "do_remote_prefill is not supported"),
    ],
)
def test_bad_kv_transfer_params_are_named(params: bytes, problem: str) -> None:
    body = _decode(b'{"prompt": "x", "kv_transfer_params": ' + params + b"}", CompletionRequest)
    with pytest.raises(ApiError, match=problem) as caught:
        sampling_params(body, max_tokens=4, logprobs=None)
    assert caught.value.status == 400 and caught.value.param == "kv_transfer_params"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "x", "top_p": 0}', "top_p"),
        (b'{"prompt": "x", "frequency_penalty": -3}', "frequency_penalty"),
        (b'{"prompt": "x", "min_tokens": -1}', "min_tokens"),
        (b'{"prompt": "x", "stop_token_ids": [-1]}', "stop_token_ids"),
    ],
)
def test_sampling_errors_name_the_field(body: bytes, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        request = _decode(body, CompletionRequest)
        sampling_params(request, max_tokens=4, logprobs=None)  # type: ignore[arg-type]
    assert caught.value.status == 400 and caught.value.param == param


def test_chat_renames_logprobs_to_top_logprobs() -> None:
    request = _decode(
        b'{"messages": [], "logprobs": true, "top_logprobs": 50}', ChatCompletionRequest
    )
    with pytest.raises(ApiError) as caught:
        sampling_params(request, max_tokens=4, logprobs=50, rename={"logprobs": "top_logprobs"})  # type: ignore[arg-type]
    assert caught.value.param == "top_logprobs" and caught.value.message.startswith("top_logprobs")


def test_decode_errors_are_typed() -> None:
    for body, code, param in [
        (b"{", "invalid_json", None),
        (b'{"prompt": true}', "invalid_type", "prompt"),
        (b'{"prompt": "x", "n": 0}', "invalid_value", "n"),
        (b'{"n": 1}', "missing_required_parameter", "prompt"),
    ]:
        with pytest.raises(ApiError) as caught:
            _decode(body, CompletionRequest)
        assert (caught.value.code, caught.value.param) == (code, param), body


def test_malformed_tools_are_refused_naming_the_field() -> None:
    for body, param in [
        (b'{"messages": [], "tools": [{"type": "function"}]}', "tools[0].function"),
        (b'{"messages": [], "tools": [{"type": "web", "function": {"name": "f"}}]}', "tools"),
        (b'{"messages": [], "tools": [{"function": {"name": 3}}]}', "tools"),
        (b'{"messages": [], "tools": [{"function": {"name": "f", "parameters": 1}}]}', "tools"),
        (b'{"messages": [], "tool_choice": {"function": {}}}', "tool_choice.function.name"),
        (b'{"messages": [], "tool_choice": 3}', "tool_choice"),
    ]:
        with pytest.raises(ApiError) as caught:
            check_unsupported(_decode(body, ChatCompletionRequest))  # type: ignore[arg-type]
        assert caught.value.param == param, body


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"response_format": {"type": "text"}}', None),
        (
            b'{"response_format": {"type": "json_object"}}',
            SOP(json_object=True),
        ),
        (
            b'{"response_format": {"type": "json_schema", "json_schema": {"name": "n", '
            b'"schema": {"type": "integer"}}}}',
            SOP(json={"type": "integer"}),
        ),
        (
            b'{"structured_outputs": {"choice": ["a", "b"]}}',
            SOP(choice=["a", "b"]),
        ),
        (b'{"guided_regex": "[0-9]+"}', SOP(regex="[0-9]+")),
        (b'{"guided_json": "{}"}', SOP(json="{}")),
        (b'{"guided_choice": ["x"]}', SOP(choice=["x"])),
        (
            b'{"guided_grammar": "root ::= \\"a\\""}',
            SOP(grammar='root ::= "a"'),
        ),
    ],
)
def test_output_constraints_are_read_from_every_field(body: bytes, expected: object) -> None:
    request = _decode(b'{"messages": [], ' + body[1:], ChatCompletionRequest)
    assert sampling_params(request, max_tokens=4, logprobs=None).structured_outputs == expected


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (b'{"response_format": {"type": "xml"}}', "response_format", "must be text, json_object"),
        (b'{"response_format": {"type": "json_schema"}}', "response_format", "json_schema.schema"),
        (b'{"structured_outputs": {}}', "structured_outputs", "exactly one of"),
        (b'{"structured_outputs": {"regex": 3}}', "structured_outputs", "Expected `str"),
        (
            b'{"guided_regex": "a", "guided_choice": ["b"]}',
            "guided_choice",
            "one output constraint",
        ),
    ],
)
def test_bad_output_constraints_are_400s_naming_the_field(
    body: bytes, param: str, message: str
) -> None:
    request = _decode(b'{"prompt": "x", ' + body[1:], CompletionRequest)
    with pytest.raises(ApiError) as caught:
        sampling_params(request, max_tokens=4, logprobs=None)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert message in caught.value.message


def test_logit_bias_and_allowed_token_ids_reach_the_sampling_params() -> None:
    body = b'{"messages": [], "logit_bias": {"5": 100, "7": -2.5}, "allowed_token_ids": [5, 7]}'
    chat = _decode(body, ChatCompletionRequest)
    check_unsupported(chat)
    params = sampling_params(chat, max_tokens=4, logprobs=None, vocab_size=8)
    assert params.logit_bias == {5: 100.0, 7: -2.5} and params.allowed_token_ids == [5, 7]
    plain = sampling_params(
        _decode(b'{"prompt": "x"}', CompletionRequest), max_tokens=4, logprobs=None
    )
    assert plain.logit_bias is None and plain.allowed_token_ids is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (b'"logit_bias": {"five": 1}', "logit_bias"),
        (b'"logit_bias": {"1.5": 1}', "logit_bias"),
        (b'"logit_bias": {"5": 100.5}', "logit_bias"),
        (b'"logit_bias": {"5": -101}', "logit_bias"),
        (b'"logit_bias": {"-3": 1}', "logit_bias"),
        (b'"logit_bias": {"8": 1}', "logit_bias"),  # out of the vocabulary (8 tokens)
        (b'"allowed_token_ids": []', "allowed_token_ids"),
        (b'"allowed_token_ids": [1, 8]', "allowed_token_ids"),
    ],
)
def test_bad_logit_bias_or_allowed_token_ids_is_a_400_naming_it(fields: bytes, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        request = _decode(b'{"prompt": "x", ' + fields + b"}", CompletionRequest)
        sampling_params(request, max_tokens=4, logprobs=None, vocab_size=8)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert param in caught.value.message


def test_chat_messages_join_text_parts() -> None:
    parts = [ContentPart("text", "a"), ContentPart("text", "b")]
    messages = [ChatMessage("system", "s"), ChatMessage("user", parts), ChatMessage("assistant")]
    assert chat_messages(messages) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]


def bos_tokenizer() -> Any:
    """The fake's tokenizer, made to add BOS (``<s>``) when asked for special tokens."""
    from tokenizers import processors

    tokenizer = copy.deepcopy(fake_tokenizer())
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    return tokenizer


def test_integers_may_come_as_floats_or_numeric_strings() -> None:
    body = _decode(
        b'{"prompt": [5.0, 6], "n": 2.0, "max_tokens": 14.0, "logprobs": 1.0, "seed": 7.0,'
        b' "top_k": "5", "min_tokens": 1.0, "stop_token_ids": [9.0], "echo": "true"}',
        CompletionRequest,
    )
    assert body.prompt == [5, 6] and body.echo is True
    values = (body.n, body.max_tokens, body.logprobs, body.seed, body.top_k, body.min_tokens)
    assert values == (2, 14, 1, 7, 5, 1) and body.stop_token_ids == [9]
    assert all(type(v) is int for v in values)
    chat = _decode(
        b'{"messages": [], "top_logprobs": 3.0, "max_completion_tokens": 8.0}',
        ChatCompletionRequest,
    )
    assert (chat.top_logprobs, chat.max_completion_tokens) == (3, 8)
    for bad in (b'{"prompt": "x", "n": 1.5}', b'{"prompt": "x", "max_tokens": "ten"}'):
        with pytest.raises(ApiError) as caught:
            _decode(bad, CompletionRequest)
        assert caught.value.code == "invalid_type", bad


COMPLETION_NULLS = (
    b'{"prompt": "x", "n": null, "echo": null, "stream": null, "logprobs": null,'
    b' "max_tokens": null, "temperature": null, "top_p": null, "stop": null, "seed": null,'
    b' "suffix": null, "stream_options": null, "logit_bias": null, "presence_penalty": null,'
    b' "frequency_penalty": null, "user": null}'
)
CHAT_NULLS = (
    b'{"messages": [{"role": "user", "content": null}], "n": null, "stream": null,'
    b' "logprobs": null, "top_logprobs": null, "max_tokens": null, "echo": null,'
    b' "max_completion_tokens": null, "stop": null, "seed": null, "stream_options": null,'
    b' "temperature": null, "top_p": null, "presence_penalty": null, "frequency_penalty": null,'
    b' "logit_bias": null}'
)


def test_null_is_the_default() -> None:
    body = _decode(COMPLETION_NULLS, CompletionRequest)
    check_unsupported(body)
    assert body.num_choices == 1 and not body.stream and not body.echo and body.logprobs is None
    params = sampling_params(body, max_tokens=4, logprobs=body.logprobs)
    assert params.n == 1 and params.temperature == 1.0 and params.top_p == 1.0
    chat = _decode(CHAT_NULLS, ChatCompletionRequest)
    check_unsupported(chat)
    assert chat.num_choices == 1 and not chat.stream and not chat.logprobs
    assert chat_messages(chat.messages) == [{"role": "user", "content": ""}]


def test_the_function_role_is_accepted_with_its_name() -> None:
    chat = _decode(
        b'{"messages": [{"role": "user", "content": "x"},'
        b' {"role": "function", "name": "lookup", "content": "42"}]}',
        ChatCompletionRequest,
    )
    assert chat_messages(chat.messages)[1] == {
        "role": "function",
        "content": "42",
        "name": "lookup",
    }


def test_add_special_tokens_both_ways() -> None:
    tokenizer = bos_tokenizer()
    bos, ids = tokenizer.bos_token_id, fake_tokenizer().encode("the fox")
    vocab = fake_vocabulary()
    with_bos = completion_prompts("the fox", tokenizer, vocab)
    assert with_bos[0].token_ids == [bos, *ids]  # the completions default: True
    batch = completion_prompts(["the fox", "a"], tokenizer, vocab, add_special_tokens=False)
    assert batch[0].token_ids == ids
    assert completion_prompts([ids], tokenizer, vocab, add_special_tokens=True)[0].token_ids == ids
    assert _decode(b'{"prompt": "x"}', CompletionRequest).add_special_tokens is True
    assert _decode(b'{"messages": []}', ChatCompletionRequest).add_special_tokens is False
