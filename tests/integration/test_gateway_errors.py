"""Bad input, auth, overload, engine failure and client disconnects against a served gateway:
each gets the right status and an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from tests.integration.conditions import wait_for
from tests.unit.test_gateway_fake import MODEL_NAME, FakeEngineClient, fake_tokenizer, serve_gateway

pytestmark = pytest.mark.timeout(120)

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "the lazy dog " * 200

# (path, body (bytes sent as is, or JSON), status, error code, param)
BAD_INPUTS: list[tuple[str, Any, int, str | None, str | None]] = [
    (CMPL, b'{"prompt": ', 400, "invalid_json", None),
    (CMPL, b"\xff\xfe not utf-8", 400, "invalid_json", None),
    (CMPL, b"[1, 2]", 400, "invalid_type", None),
    (CMPL, {}, 400, "missing_required_parameter", "prompt"),
    (CMPL, {"prompt": 5}, 400, "invalid_type", "prompt"),
    (CMPL, {"prompt": "hi", "max_tokens": "ten"}, 400, "invalid_type", "max_tokens"),
    (CMPL, {"prompt": "hi", "stream": "yes"}, 400, "invalid_type", "stream"),
    (CMPL, {"prompt": "hi", "seed": 1.5}, 400, "invalid_type", "seed"),
    # Integers msgpack cannot carry to the engine core (it would fail there, as a 503).
    (CMPL, {"prompt": "hi", "seed": 2**64}, 400, "invalid_value", "seed"),
    (CMPL, {"prompt": "hi", "seed": -(2**63) - 1}, 400, "invalid_value", "seed"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [2**64]}, 400, "invalid_value", "stop_token_ids"),
    (CMPL, b'{"prompt": "hi", "temperature": 1e400}', 400, "invalid_value", "temperature"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    (CMPL, {"prompt": "hi", "temperature": -1}, 400, "invalid_value", "temperature"),
    (CMPL, {"prompt": "hi", "top_p": 0}, 400, "invalid_value", "top_p"),
    (CMPL, {"prompt": "hi", "top_k": -5}, 400, "invalid_value", "top_k"),
    (CMPL, {"prompt": "hi", "min_p": 2}, 400, "invalid_value", "min_p"),
    (CMPL, {"prompt": "hi", "presence_penalty": 5}, 400, "invalid_value", "presence_penalty"),
    (CMPL, {"prompt": "hi", "repetition_penalty": 0}, 400, "invalid_value", "repetition_penalty"),
    (CMPL, {"prompt": "hi", "n": 0}, 400, "invalid_value", "n"),
    (CMPL, {"prompt": "hi", "n": 100000}, 400, "invalid_value", "n"),
    (CMPL, {"prompt": "hi", "logprobs": 21}, 400, "invalid_value", "logprobs"),
    (CMPL, {"prompt": "hi", "stop": [""]}, 400, "invalid_value", "stop"),
    (CMPL, {"prompt": "hi", "max_tokens": 4, "min_tokens": 9}, 400, "invalid_value", "min_tokens"),
    (CMPL, {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "invalid_value", "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "invalid_value", "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"5": "hi"}}, 400, "invalid_type", "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "invalid_value", "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {"-1": 1}}, 400, "invalid_value", "logit_bias"),
    (CMPL, {"prompt": "hi", "allowed_token_ids": []}, 400, "invalid_value", "allowed_token_ids"),
    (CMPL, {"prompt": "hi", "allowed_token_ids": [-2]}, 400, "invalid_value", "allowed_token_ids"),
    (
        CHAT,
        {"messages": USER, "allowed_token_ids": [5, 999999]},
        400,
        "invalid_value",
        "allowed_token_ids",
    ),
    (CMPL, {"prompt": "hi", "suffix": "x"}, 400, "invalid_value", "suffix"),
    (CMPL, {"prompt": ""}, 400, "invalid_value", "prompt"),
    (CMPL, {"prompt": []}, 400, "invalid_value", "prompt"),
    (CMPL, {"prompt": [[]]}, 400, "invalid_value", "prompt"),
    (CMPL, {"prompt": ["a", 1]}, 400, "invalid_value", "prompt"),
    (CMPL, {"prompt": [999999]}, 400, "invalid_value", "prompt"),
    (CMPL, {"prompt": [-1]}, 400, "invalid_value", "prompt"),
    (CMPL, {"prompt": LONG_PROMPT}, 400, "context_length_exceeded", "prompt"),
    (CMPL, {"prompt": "hi", "model": "no-such-model"}, 404, "model_not_found", "model"),
    (CHAT, {}, 400, "missing_required_parameter", "messages"),
    (CHAT, {"messages": []}, 400, "invalid_value", "messages"),
    (CHAT, {"messages": "hi"}, 400, "invalid_type", "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value", "messages"),
    (
        CHAT,
        {"messages": [{"content": "x"}]},
        400,
        "missing_required_parameter",
        "messages[0].role",  # OpenAI's param: the field's whole path
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "invalid_value",
        "messages",
    ),
    (
        CHAT,
        {"messages": USER, "logprobs": True, "top_logprobs": 30},
        400,
        "invalid_value",
        "top_logprobs",
    ),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "invalid_value", "top_logprobs"),
    (
        CHAT,
        {"messages": USER, "max_completion_tokens": -3},
        400,
        "invalid_value",
        "max_completion_tokens",
    ),
    (
        CHAT,
        {"messages": USER, "tools": [{"type": "function"}]},
        400,
        "missing_required_parameter",
        "tools[0].function",
    ),
    (
        CHAT,
        {"messages": USER, "response_format": {"type": "xml"}},
        400,
        "invalid_value",
        "response_format",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": LONG_PROMPT}]},
        400,
        "context_length_exceeded",
        "messages",
    ),
    (CHAT, {"messages": USER, "model": "gpt-4"}, 404, "model_not_found", "model"),
    ("/tokenize", {"prompt": "a", "messages": USER}, 400, "invalid_value", "prompt"),
    ("/tokenize", {"prompt": 3}, 400, "invalid_type", "prompt"),
    ("/detokenize", {"tokens": [10**9]}, 400, "invalid_value", "tokens"),
    ("/v1/nothing", {}, 404, "not_found", None),
]


def _check_error_body(body: dict[str, Any], code: str | None, param: str | None) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == code and error["param"] == param


async def _post(session: aiohttp.ClientSession, url: str, body: Any) -> aiohttp.ClientResponse:
    if isinstance(body, bytes):
        return await session.post(url, data=body, headers={"Content-Type": "application/json"})
    return await session.post(url, json=body)


async def check_bad_inputs(
    session: aiohttp.ClientSession,
    url: str,
    table: list[tuple[str, Any, int, str | None, str | None]],
) -> None:
    """Every row of ``table``, streamed and not, gets its status and an OpenAI error body."""
    for stream in (False, True):
        for path, body, status, code, param in table:
            if (
                stream
                and isinstance(body, dict)
                and path.startswith("/v1/c")
                and "stream" not in body
            ):
                body = {**body, "stream": True}
            async with await _post(session, url + path, body) as response:
                assert response.status == status, (path, body, await response.text())
                assert response.content_type == "application/json"
                _check_error_body(await response.json(), code, param)


async def test_bad_inputs_get_openai_errors_and_server_stays_healthy() -> None:
    async with serve_gateway() as (url, engine), aiohttp.ClientSession() as session:
        await check_bad_inputs(session, url, BAD_INPUTS)
        async with session.get(url + CMPL) as response:
            assert response.status == 405
            _check_error_body(await response.json(), "method_not_allowed", None)
        async with session.get(url + "/health") as response:
            assert response.status == 200
        async with session.post(
            url + CMPL, json={"prompt": "the fox", "max_tokens": 3}
        ) as response:
            assert response.status == 200
            assert (await response.json())["choices"][0]["finish_reason"] == "length"
    assert not engine.in_flight


async def test_unready_and_overloaded_engine_answer_503() -> None:
    async with serve_gateway() as (url, engine), aiohttp.ClientSession() as session:
        engine.ready = False
        async with session.get(url + "/health") as response:
            assert response.status == 503
        for stream in (False, True):
            body = {"prompt": "hi", "stream": stream}
            async with session.post(url + CMPL, json=body) as response:
                assert response.status == 503
                _check_error_body(await response.json(), "engine_unavailable", None)
        engine.ready, engine.max_in_flight = True, 0
        async with session.get(url + "/health") as response:
            assert response.status == 200
        for stream in (False, True):
            chat_body: dict[str, Any] = {"messages": USER, "stream": stream}
            async with session.post(url + CHAT, json=chat_body) as response:
                assert response.status == 503
                _check_error_body(await response.json(), "engine_unavailable", None)
        engine.max_in_flight = 10
        async with session.post(url + CMPL, json={"prompt": "hi"}) as response:
            assert response.status == 200


async def test_engine_failure_mid_request_is_an_error_not_a_crash() -> None:
    async with serve_gateway() as (url, engine), aiohttp.ClientSession() as session:
        engine.fail_at_step = 3
        async with session.post(url + CMPL, json={"prompt": "hi", "max_tokens": 9}) as response:
            assert response.status == 503
            _check_error_body(await response.json(), "engine_error", None)
        body = {"prompt": "hi", "max_tokens": 9, "stream": True}
        async with session.post(url + CMPL, json=body) as response:
            assert response.status == 200
            events = [line async for line in response.content if line.strip()]
        assert events[-1] == b"data: [DONE]\n"
        assert b'"engine_error"' in events[-2] and b'"error"' in events[-2]
        engine.fail_at_step = None
        async with session.post(url + CMPL, json={"prompt": "hi"}) as response:
            assert response.status == 200


async def test_api_key_guards_v1_only() -> None:
    async with serve_gateway(api_key="sekret") as (url, _), aiohttp.ClientSession() as session:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            async with session.post(url + CMPL, json={"prompt": "hi"}, headers=headers) as response:
                assert response.status == 401
                _check_error_body(await response.json(), "invalid_api_key", None)
        async with session.get(url + "/v1/models") as response:
            assert response.status == 401
        for path in ("/health", "/metrics", "/version"):
            async with session.get(url + path) as response:
                assert response.status == 200
        good = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0)
        result = await good.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert result.usage is not None and result.usage.completion_tokens == 2
        bad = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.completions.create(model=MODEL_NAME, prompt="hi")


@pytest.mark.parametrize("path", [CMPL, CHAT])
async def test_client_disconnect_mid_stream_aborts(path: str) -> None:
    engine = FakeEngineClient(token_delay=0.01)
    body: dict[str, Any] = {"max_tokens": 200, "stream": True}
    body.update({"prompt": "the fox"} if path == CMPL else {"messages": USER})
    async with serve_gateway(engine) as (url, _), aiohttp.ClientSession() as session:
        response = await session.post(url + path, json=body)
        assert response.status == 200
        for _ in range(3):
            assert (await response.content.readline()).startswith(b"data: ")
            await response.content.readline()
        assert len(engine.in_flight) == 1
        response.close()  # drop the connection mid-stream
        await wait_for(lambda: not engine.in_flight, 5.0, "the request aborted")
        assert len(engine.aborted) == 1 and not engine.finished
        async with session.post(url + CMPL, json={"prompt": "hi", "max_tokens": 2}) as response:
            assert response.status == 200


async def test_client_timeout_on_non_streaming_request_aborts() -> None:
    engine = FakeEngineClient(token_delay=0.01)
    async with serve_gateway(engine) as (url, _), aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            timeout = aiohttp.ClientTimeout(total=0.3)
            body = {"prompt": "x", "max_tokens": 200}
            await session.post(url + CMPL, json=body, timeout=timeout)
        await wait_for(lambda: not engine.in_flight, 5.0, "the request aborted")
        assert len(engine.aborted) == 1 and not engine.finished


async def test_token_ids_from_the_vocabulary_size_up_are_refused() -> None:
    vocab_size = len(fake_tokenizer())
    async with serve_gateway() as (url, _), aiohttp.ClientSession() as session:
        for path, body, param in (
            (CMPL, {"prompt": [vocab_size]}, "prompt"),
            ("/detokenize", {"tokens": [vocab_size]}, "tokens"),
        ):
            async with await _post(session, url + path, body) as response:
                assert response.status == 400, (path, await response.text())
                _check_error_body(await response.json(), "invalid_value", param)
        last_id = {"prompt": [vocab_size - 1], "max_tokens": 1}
        async with await _post(session, url + CMPL, last_id) as response:
            assert response.status == 200, await response.text()
