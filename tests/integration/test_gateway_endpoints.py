"""The small endpoints: models, health/ping, load, version, tokenize and detokenize; and the
stream never carries empty chunks."""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.unit.test_gateway_fake import MODEL_NAME, FakeEngineClient, serve_gateway

pytestmark = pytest.mark.timeout(60)


async def test_models_health_load_version() -> None:
    async with serve_gateway() as (url, engine), aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/models") as response:
            models = await response.json()
        assert models["object"] == "list"
        (card,) = models["data"]
        assert card["id"] == MODEL_NAME and card["object"] == "model"
        assert card["max_model_len"] == engine.max_model_len
        for method in ("GET", "POST"):
            async with session.request(method, url + "/ping") as response:
                assert response.status == 200
        async with session.get(url + "/load") as response:
            assert await response.json() == {"server_load": 0}
        async with session.get(url + "/version") as response:
            assert isinstance((await response.json())["version"], str)
        engine.ready = False
        async with session.get(url + "/ping") as response:
            assert response.status == 503


async def test_tokenize_and_detokenize_round_trip() -> None:
    async with serve_gateway() as (url, engine), aiohttp.ClientSession() as session:
        body = {"prompt": "the lazy dog", "return_token_strs": True}
        async with session.post(url + "/tokenize", json=body) as response:
            tokens = await response.json()
        ids = engine.tokenizer.encode("the lazy dog")
        assert tokens["tokens"] == ids and tokens["count"] == len(ids)
        assert tokens["max_model_len"] == engine.max_model_len
        assert tokens["token_strs"] == engine.tokenizer.convert_ids_to_tokens(ids)
        messages = [{"role": "user", "content": "hi"}]
        async with session.post(url + "/tokenize", json={"messages": messages}) as response:
            assert (await response.json())["tokens"] == engine.encode_chat(messages)
        async with session.post(url + "/detokenize", json={"tokens": ids}) as response:
            assert await response.json() == {"prompt": "the lazy dog"}


async def test_stream_has_no_empty_chunks_while_holding_back_a_stop_string() -> None:
    engine = FakeEngineClient()
    async with serve_gateway(engine) as (url, _), aiohttp.ClientSession() as session:
        body = {"prompt": "the", "max_tokens": 12}
        async with session.post(url + "/v1/completions", json=body) as response:
            full = (await response.json())["choices"][0]["text"]
        stop = full.split()[6] + " " + full.split()[7][:2]  # a long stop string, held back
        body = {**body, "stop": [stop], "stream": True}
        async with session.post(url + "/v1/completions", json=body) as response:
            lines = [line async for line in response.content if line.startswith(b"data: {")]
    choices = [json.loads(line[6:])["choices"][0] for line in lines]
    assert all(c["text"] or c["finish_reason"] for c in choices)
    assert [c["finish_reason"] for c in choices].count("stop") == 1
    assert "".join(c["text"] for c in choices) == full[: full.index(stop)]
