"""The NATS API takes the inputs the HTTP API now accepts where the two share types: integers as
``14.0`` (JSON and msgpack), the chat role ``function``, and ``add_special_tokens`` (true for a
text prompt, false for messages, unless given)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.gateway.nats_api import NatsApi
from shoal.gateway.serving import serving_context
from tests.unit.test_gateway_fake import FakeEngineClient
from tests.unit.test_gateway_params import bos_tokenizer

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 20.0
USER = {"role": "user", "content": "the quick brown fox"}


@pytest.fixture
async def served() -> AsyncIterator[tuple[InMemoryBus, NatsApi, FakeEngineClient]]:
    broker = InMemoryBroker()
    server_bus, client_bus = InMemoryBus(broker), InMemoryBus(broker)
    await server_bus.connect()
    await client_bus.connect()
    engine = FakeEngineClient()
    engine.tokenizer = bos_tokenizer()
    api = NatsApi(server_bus, serving_context(engine))
    await api.start()
    yield client_bus, api, engine
    await api.stop()
    await client_bus.close()
    await server_bus.close()


async def _ask(bus: InMemoryBus, api: NatsApi, request: dict[str, Any], packed: bool) -> Any:
    payload = msgspec.msgpack.encode(request) if packed else json.dumps(request).encode()
    reply = await bus.request(api.subjects.api_generate(), payload, timeout=TIMEOUT)
    answer = msgspec.msgpack.decode(reply.data) if packed else json.loads(reply.data)
    assert answer["type"] == "result", answer
    return answer


@pytest.mark.parametrize("packed", [False, True])
async def test_integers_as_floats_and_the_function_role(served, packed: bool) -> None:  # type: ignore[no-untyped-def]
    bus, api, engine = served
    params = {"max_tokens": 3.0, "n": 2.0, "seed": 5.0}
    text = await _ask(bus, api, {"prompt": "the fox", "sampling_params": params}, packed)
    assert [len(c["token_ids"]) for c in text["choices"]] == [3, 3]
    function = {"role": "function", "name": "lookup", "content": "forty two"}
    chat = {"messages": [USER, function], "sampling_params": {"max_tokens": 2.0}}
    await _ask(bus, api, chat, packed)
    prompt = engine.tokenizer.decode(engine.requests[-1][1], skip_special_tokens=False)
    assert "<|function|>forty two" in prompt


async def test_add_special_tokens_both_ways(served) -> None:  # type: ignore[no-untyped-def]
    bus, api, engine = served
    bos = engine.tokenizer.bos_token_id
    params = {"max_tokens": 1}
    for add in (None, True, False):
        extra = {} if add is None else {"add_special_tokens": add}
        await _ask(bus, api, {"prompt": "the fox", "sampling_params": params, **extra}, False)
        await _ask(bus, api, {"messages": [USER], "sampling_params": params, **extra}, False)
    firsts = [prompt[0] == bos for _, prompt, _ in engine.requests]
    assert firsts == [True, False, True, True, False, False]


@pytest.mark.parametrize("packed", [False, True])
async def test_logit_bias_and_allowed_token_ids_reach_the_engine(served, packed: bool) -> None:  # type: ignore[no-untyped-def]
    bus, api, engine = served
    params = {"max_tokens": 2, "logit_bias": {"5": 100.0}, "allowed_token_ids": [5, 9]}
    await _ask(bus, api, {"prompt": "the fox", "sampling_params": params}, packed)
    got = engine.requests[-1][2]
    assert got.logit_bias == {5: 100.0} and got.allowed_token_ids == [5, 9]
    vocab = len(engine.tokenizer)
    for field, value in (("logit_bias", {str(vocab): 1.0}), ("allowed_token_ids", [1, vocab])):
        bad = {"prompt": "the fox", "sampling_params": {field: value}}
        reply = await bus.request(
            api.subjects.api_generate(), json.dumps(bad).encode(), timeout=TIMEOUT
        )
        answer = json.loads(reply.data)
        assert answer["type"] == "error" and answer["status"] == 400, answer
        assert answer["error"]["param"] == field and str(vocab) in answer["error"]["message"]


OWN_TEMPLATE = (  # a request's own template, showing every chat-template field
    "{% for d in documents or [] %}[{{ d['title'] }}]{% endfor %}"
    "{% if mood is defined %}({{ mood }}){% endif %}"
    "{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}assistant={% endif %}"
)


async def _error(bus: InMemoryBus, api: NatsApi, request: dict[str, Any]) -> Any:
    payload = json.dumps(request).encode()
    reply = await bus.request(api.subjects.api_generate(), payload, timeout=TIMEOUT)
    answer = json.loads(reply.data)
    assert answer["type"] == "error" and answer["status"] == 400, answer
    return answer["error"]


async def test_chat_template_fields_reach_the_prompt(served) -> None:  # type: ignore[no-untyped-def]
    bus, api, engine = served
    prefilled = [USER, {"role": "assistant", "content": "jumps"}]
    params = {"max_tokens": 1}
    untrusted = {"messages": [USER], "sampling_params": params, "chat_template": OWN_TEMPLATE}
    assert (await _error(bus, api, untrusted))["param"] == "chat_template"
    api.ctx.trust_request_chat_template = True  # --trust-request-chat-template
    for fields, expected in (
        ({}, "user=the quick brown fox;assistant="),
        ({"add_generation_prompt": False}, "user=the quick brown fox;"),
        ({"chat_template_kwargs": {"mood": "calm"}}, "(calm)user=the quick brown fox;assistant="),
        ({"documents": [{"title": "t", "text": "x"}]}, "[t]user=the quick brown fox;assistant="),
    ):
        await _ask(bus, api, {**untrusted, **fields}, False)
        assert engine.tokenizer.decode(engine.requests[-1][1]) == expected, fields
    continued = {"messages": prefilled, "sampling_params": params, "continue_final_message": True}
    await _ask(bus, api, {**continued, "add_generation_prompt": False}, False)
    prompt = engine.tokenizer.decode(engine.requests[-1][1], skip_special_tokens=False)
    assert prompt.endswith("<|assistant|>jumps")  # the model's template, left open
    refusals = {
        "continue_final_message": {**continued},  # add_generation_prompt is true by default
        "chat_template_kwargs": {**untrusted, "chat_template_kwargs": {"tokenize": True}},
    }
    for param, request in refusals.items():
        assert (await _error(bus, api, request))["param"] == param
