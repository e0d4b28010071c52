"""Inputs OpenAI and vLLM accept and third-party clients send, over a served gateway (fake
engine): integers as ``14.0``, ``null`` for optional fields, ``echo`` with ``max_tokens: 0`` (a
prompt scored without generation), the ``function`` role, ``add_special_tokens`` both ways, and
``GET /tokenizer_info``. Every answer is also checked against OpenAI's schema."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from shoal.gateway.logprobs import TokenText
from tests.fixtures.openai_schema import CHAT, COMPLETIONS, post_checked
from tests.unit.test_gateway_fake import CHAT_TEMPLATE, FakeEngineClient, serve_gateway
from tests.unit.test_gateway_params import CHAT_NULLS, COMPLETION_NULLS, bos_tokenizer

pytestmark = pytest.mark.timeout(120)

USER = [{"role": "user", "content": "the quick brown fox"}]


async def test_integers_sent_as_floats() -> None:
    engine = FakeEngineClient()
    async with serve_gateway(engine) as (url, _), aiohttp.ClientSession() as session:
        body = {"prompt": "the fox", "max_tokens": 3.0, "n": 2.0, "logprobs": 1.0, "seed": 7.0}
        whole = await post_checked(session, url, COMPLETIONS, body)
        chat = {"messages": USER, "max_tokens": 2.0, "logprobs": True, "top_logprobs": 2.0}
        chunks = await post_checked(session, url, CHAT, {**chat, "stream": True})
    assert len(whole["choices"]) == 2 and whole["usage"]["completion_tokens"] == 6
    params = engine.requests[0][2]
    assert (params.n, params.max_tokens, params.logprobs, params.seed) == (2, 3, 1, 7)
    tops = [e["top_logprobs"] for c in chunks if c["choices"] for e in _content(c)]
    assert len(tops) == 2 and all(len(top) == 2 for top in tops)


def _content(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    logprobs = chunk["choices"][0].get("logprobs")
    return logprobs["content"] if logprobs else []


async def test_null_for_optional_fields_is_the_default() -> None:
    engine = FakeEngineClient(eos_after=3)
    async with serve_gateway(engine) as (url, _), aiohttp.ClientSession() as session:
        whole = await post_checked(session, url, COMPLETIONS, json.loads(COMPLETION_NULLS))
        chat = await post_checked(session, url, CHAT, json.loads(CHAT_NULLS))
    assert len(whole["choices"]) == 1 and whole["choices"][0]["logprobs"] is None
    assert whole["choices"][0]["finish_reason"] == "stop"  # max_tokens null: all the room left
    assert len(chat["choices"]) == 1 and chat["choices"][0]["logprobs"] is None


async def test_echo_with_max_tokens_zero_scores_the_prompt() -> None:
    engine = FakeEngineClient()
    prompt = "the lazy dog jumps"
    ids = engine.tokenizer.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    async with serve_gateway(engine) as (url, _), aiohttp.ClientSession() as session:
        whole = await post_checked(session, url, COMPLETIONS, body)
        chunks = await post_checked(session, url, COMPLETIONS, {**body, "stream": True})
        bare = await post_checked(session, url, COMPLETIONS, {**body, "logprobs": None})
        async with session.post(url + COMPLETIONS, json={**body, "echo": False}) as response:
            refused = response.status, (await response.json())["error"]["param"]
    (choice,) = whole["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    text = TokenText(engine.tokenizer)
    assert logprobs["tokens"] == [text(t) for t in ids]
    assert logprobs["token_logprobs"] == [None] + [-0.5] * (len(ids) - 1)  # the fake's logprobs
    assert logprobs["top_logprobs"][0] is None and len(logprobs["top_logprobs"]) == len(ids)
    assert whole["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
    }
    assert engine.requests[0][2].max_tokens == 1 and engine.requests[0][2].prompt_logprobs == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt
    assert [c["choices"][0]["logprobs"] for c in chunks] == [logprobs]
    assert bare["choices"][0]["text"] == prompt and bare["choices"][0]["logprobs"] is None
    assert refused == (400, "max_tokens")  # without echo, max_tokens 0 stays refused


async def test_the_function_role_reaches_the_chat_template() -> None:
    engine = FakeEngineClient()
    messages = [*USER, {"role": "function", "name": "lookup", "content": "forty two"}]
    async with serve_gateway(engine) as (url, _), aiohttp.ClientSession() as session:
        await post_checked(session, url, CHAT, {"messages": messages, "max_tokens": 2})
    prompt = engine.tokenizer.decode(engine.requests[0][1], skip_special_tokens=False)
    assert "<|function|>forty two\n<|assistant|>" in prompt


async def test_add_special_tokens_both_ways() -> None:
    engine = FakeEngineClient()
    engine.tokenizer = bos_tokenizer()
    bos = engine.tokenizer.bos_token_id
    async with serve_gateway(engine) as (url, _), aiohttp.ClientSession() as session:
        for add in (None, True, False):
            body = {"prompt": "the fox", "max_tokens": 1}
            if add is not None:
                body["add_special_tokens"] = add
            await post_checked(session, url, COMPLETIONS, body)
            await post_checked(session, url, CHAT, {**body, "messages": USER, "prompt": None})
    firsts = [prompt[0] == bos for _, prompt, _ in engine.requests]
    # completions: BOS by default; chat: none by default (the template has its own)
    assert firsts == [True, False, True, True, False, False]


async def test_tokenizer_info() -> None:
    async with (
        serve_gateway() as (url, engine),
        aiohttp.ClientSession() as session,
        session.get(url + "/tokenizer_info") as response,
    ):
        assert response.status == 200
        info = await response.json()
    assert info["tokenizer_class"] == type(engine.tokenizer).__name__
    assert info["chat_template"] == CHAT_TEMPLATE
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<s>", "</s>", "<pad>")
    assert info["added_tokens_decoder"]["2"] == "</s>"
    assert isinstance(info["model_max_length"], int)
    assert "name_or_path" not in info and "vocab_file" not in info
