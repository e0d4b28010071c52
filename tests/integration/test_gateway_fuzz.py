"""Random bodies (valid requests with fields mutated, dropped or added) never get a 500 and never
stop the server: every answer is a success or an OpenAI-shaped 4xx/503."""

from __future__ import annotations

import json
import random
from typing import Any

import aiohttp
import pytest

from tests.unit.test_gateway_fake import FakeEngineClient, serve_gateway

pytestmark = pytest.mark.timeout(180)

ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    -(2**63),
    2**64 - 1,
    0.5,
    -0.0,
    1e308,
    -1e308,
    "",
    "x",
    "\x00\ud7ff",
    "🦊" * 50,
    [],
    [None],
    [1, "a"],
    [[1], [2]],
    [[]],
    {},
    {"a": 1},
    [0] * 300,
    ["the fox"] * 3,
    [-5],
    [10**12],
    {"include_usage": "yes"},
    {"include_usage": True},
]
COMPLETION = {
    "prompt": "the fox",
    "max_tokens": 3,
    "temperature": 0.5,
    "n": 2,
    "stop": ["dog"],
    "logprobs": 1,
    "echo": True,
    "top_k": 5,
    "seed": 1,
    "min_tokens": 1,
}
CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "logprobs": True,
    "top_logprobs": 2,
    "n": 2,
    "top_p": 0.9,
    "presence_penalty": 0.1,
}
EXTRA_KEYS = [
    "max_completion_tokens",
    "stream_options",
    "stop_token_ids",
    "ignore_eos",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "user",
    "add_generation_prompt",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "model",
    "best_of",
]


def mutate(rng: random.Random, base: dict[str, Any]) -> dict[str, Any]:
    body = dict(base)
    for _ in range(rng.randint(1, 3)):
        action = rng.random()
        if action < 0.6:
            body[rng.choice([*base, *EXTRA_KEYS])] = rng.choice(ODD_VALUES)
        elif action < 0.8 and body:
            body.pop(rng.choice(list(body)))
        else:
            body[rng.choice(EXTRA_KEYS)] = rng.choice(ODD_VALUES)
    body["stream"] = rng.random() < 0.5
    return body


async def fuzz(
    session: aiohttp.ClientSession, url: str, rng: random.Random, num_requests: int
) -> dict[int, int]:
    """Send ``num_requests`` mutated bodies (chat and completions in turn); every answer is a
    success or an OpenAI-shaped 4xx, a stream ends with [DONE] and no error. The statuses seen."""
    statuses: dict[int, int] = {}
    for number in range(num_requests):
        path, base = (
            ("/v1/completions", COMPLETION) if number % 2 else ("/v1/chat/completions", CHAT)
        )
        body = mutate(rng, base)
        data = json.dumps(body, allow_nan=False).encode()
        async with session.post(url + path, data=data) as response:
            text = await response.text()
            statuses[response.status] = statuses.get(response.status, 0) + 1
            assert response.status in (200, 400, 404), (body, text)
            if response.status != 200:
                error = json.loads(text)["error"]
                assert set(error) == {"message", "type", "param", "code"}, text
            elif body["stream"]:
                assert text.endswith("data: [DONE]\n\n") and '"error"' not in text, (body, text)
    return statuses


async def test_random_bodies_never_500() -> None:
    engine = FakeEngineClient(max_model_len=512)
    async with serve_gateway(engine) as (url, _), aiohttp.ClientSession() as session:
        statuses = await fuzz(session, url, random.Random(1234), 240)
        async with session.get(url + "/health") as response:
            assert response.status == 200
        async with session.post(url + "/v1/completions", json={"prompt": "hi"}) as response:
            assert response.status == 200
    assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 20  # both paths were exercised
    assert not engine.in_flight


async def test_huge_prompt_is_refused_before_tokenizing() -> None:
    served = serve_gateway(FakeEngineClient(max_model_len=64))
    async with served as (url, _), aiohttp.ClientSession() as session:
        body = {"prompt": "x" * (64 * 64 + 1)}
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 400
            assert (await response.json())["error"]["code"] == "context_length_exceeded"
