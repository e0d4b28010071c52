"""Every response and stream chunk of /v1/completions, /v1/chat/completions and /v1/models fits
OpenAI's published schema (tests/fixtures/openai_schema.py), over the fake engine client. The
same requests run against the real engine in test_openai_schema_real_engine."""

from __future__ import annotations

from typing import Any

import aiohttp
import jsonschema
import pytest

from tests.fixtures.openai_schema import (
    CHAT,
    CHAT_COMPLETION,
    COMPLETIONS,
    completion_schema,
    get_models_checked,
    post_checked,
    validate,
)
from tests.unit.test_gateway_fake import FakeEngineClient, serve_gateway

pytestmark = pytest.mark.timeout(120)

USER = [{"role": "user", "content": "the quick brown fox"}]
USAGE_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}

# Requests whose answers cover every shape: n > 1, batches, token ids, logprobs, echo (also
# without generation), stop and length endings, usage chunks. Each also runs streamed.
COMPLETION_BODIES: list[dict[str, Any]] = [
    {"prompt": "the fox", "max_tokens": 5},
    {"prompt": ["the fox", "a dog"], "n": 2, "max_tokens": 3},
    {"prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 2},
    {"prompt": "the fox", "max_tokens": 12, "logprobs": 0, "stop": ["zz"]},
    {"prompt": "the fox", "max_tokens": 4, "echo": True, "logprobs": 1},
    {"prompt": "the lazy dog", "max_tokens": 0, "echo": True, "logprobs": 2},
    {"prompt": "the lazy dog", "max_tokens": 0, "echo": True},
]
CHAT_BODIES: list[dict[str, Any]] = [
    {"messages": USER, "max_tokens": 5},
    {"messages": USER, "max_tokens": 12, "n": 2, "logprobs": True, "top_logprobs": 2},
    {"messages": USER, "max_tokens": 3, "logprobs": True},
    {"messages": [*USER, {"role": "assistant", "content": "it"}], "max_tokens": 3, "echo": True},
]


def streamed(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream": True, "stream_options": USAGE_OPTIONS}


async def check_every_shape(url: str) -> None:
    """Every body above, whole and streamed, fits the schema; /v1/models too."""
    async with aiohttp.ClientSession() as session:
        for path, bodies in ((COMPLETIONS, COMPLETION_BODIES), (CHAT, CHAT_BODIES)):
            for body in bodies:
                await post_checked(session, url, path, body)
                chunks = await post_checked(session, url, path, streamed(body))
                assert chunks[-1]["choices"] == [] and chunks[-1]["usage"], body
        await get_models_checked(session, url)


async def test_every_response_and_chunk_fits_openais_schema() -> None:
    async with serve_gateway(FakeEngineClient(eos_after=8)) as (url, _):
        await check_every_shape(url)


async def test_the_shapes_cover_both_endings() -> None:
    """The cases above end by length and by a stop (the fake's eos at its 9th token)."""
    engine = FakeEngineClient(eos_after=8)
    async with serve_gateway(engine) as (url, _), aiohttp.ClientSession() as session:
        short = await post_checked(session, url, COMPLETIONS, COMPLETION_BODIES[0])
        long = await post_checked(session, url, COMPLETIONS, COMPLETION_BODIES[3])
    assert short["choices"][0]["finish_reason"] == "length"
    assert long["choices"][0]["finish_reason"] == "stop"


def test_the_schemas_refuse_what_clients_refused() -> None:
    """The defects third-party clients found are refused by these schemas (so they can fail)."""
    chunk = {"id": "c", "created": 1, "model": "m", "choices": []}
    with pytest.raises(jsonschema.ValidationError, match="object"):
        validate(chunk, completion_schema(stream=True))
    message = {"role": "assistant", "content": "hi"}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
    whole = {**chunk, "object": "chat.completion", "choices": [choice]}
    with pytest.raises(jsonschema.ValidationError, match="refusal"):
        validate(whole, CHAT_COMPLETION)
    message["refusal"] = None
    validate(whole, CHAT_COMPLETION)
    with pytest.raises(jsonschema.ValidationError, match="None is not of type 'string'"):
        validate({**whole, "system_fingerprint": None}, CHAT_COMPLETION)
    choice["logprobs"] = {"content": []}
    with pytest.raises(jsonschema.ValidationError, match="refusal"):
        validate(whole, CHAT_COMPLETION)
