"""``POST /v1/embeddings`` over the real engine stack (tiny random Llama, in-memory bus) through
the official ``openai`` SDK's ``embeddings.create``: a batch of texts and of token ids, each
equal to transformers' pooled state (1e-5), base64 the same floats, ``dimensions`` refused for a
model not trained for it and shortening (renormalized) one that is; a generating server refuses
the endpoint; bad input is a 400 and the server goes on."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch

from shoal.gateway.embedding_options import EmbeddingOptions
from tests.golden.test_golden_embeddings import hf_pooled
from tests.integration.served_stack import MODEL_NAME, served_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
TEXTS = ["the quick brown fox", "jumps over the lazy dog, token by token"]


def client_of(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("matryoshka", [False, True])
async def test_embeddings_create_equals_transformers(tiny_checkpoint, matryoshka) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    app_options = {"embeddings": EmbeddingOptions(matryoshka=matryoshka)}
    async with served_stack(model_dir, app_options=app_options, runner="pooling") as served:
        client = client_of(served.url)
        tokenizer = served.stack.client.tokenizer
        ids = [tokenizer.encode(t) for t in TEXTS]
        texts = await client.embeddings.create(model=MODEL_NAME, input=TEXTS)
        tokens = await client.embeddings.create(model=MODEL_NAME, input=ids)
        packed = await client.embeddings.create(
            model=MODEL_NAME, input=TEXTS, encoding_format="base64"
        )
        assert texts.usage.prompt_tokens == sum(map(len, ids)) == texts.usage.total_tokens
        for i, prompt in enumerate(ids):
            expected = hf_pooled(model_dir, prompt, "LAST", True)
            got = torch.tensor(texts.data[i].embedding)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            assert texts.data[i].index == i
            assert tokens.data[i].embedding == texts.data[i].embedding
            raw = np.frombuffer(base64.b64decode(packed.data[i].embedding), dtype="<f4")
            assert raw.tolist() == np.float32(texts.data[i].embedding).tolist()
        if not matryoshka:
            with pytest.raises(openai.BadRequestError, match="matryoshka"):
                await client.embeddings.create(model=MODEL_NAME, input=TEXTS, dimensions=8)
        else:
            short = await client.embeddings.create(model=MODEL_NAME, input=TEXTS, dimensions=8)
            head = np.asarray(texts.data[0].embedding[:8])
            np.testing.assert_allclose(short.data[0].embedding, head / np.linalg.norm(head), 1e-5)
        await served.wait_until_idle()


async def test_raw_base64_and_bad_input(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    import aiohttp

    model_dir = tiny_checkpoint("llama")
    app_options = {"embeddings": EmbeddingOptions()}
    async with served_stack(model_dir, app_options=app_options, runner="pooling") as served:
        url = f"{served.url}/v1/embeddings"
        async with aiohttp.ClientSession() as session:
            body = {"input": TEXTS[0], "encoding_format": "base64"}
            async with session.post(url, json=body) as response:
                packed = (await response.json())["data"][0]["embedding"]
            async with session.post(url, json={"input": TEXTS[0]}) as response:
                floats = (await response.json())["data"][0]["embedding"]
            decoded = np.frombuffer(base64.b64decode(packed), dtype="<f4")
            assert decoded.tolist() == np.asarray(floats, dtype=np.float32).tolist()
            for bad in ({"input": []}, {"input": [10**9]}, {"input": TEXTS, "model": "nope"}):
                async with session.post(url, json=bad) as response:
                    assert response.status in (400, 404), bad
            async with session.post(url, json={"input": TEXTS[0]}) as response:
                assert response.status == 200
        await served.wait_until_idle()


async def test_a_generating_server_refuses_embeddings(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    async with served_stack(tiny_checkpoint("llama")) as served:
        with pytest.raises(openai.BadRequestError, match="--runner pooling"):
            await client_of(served.url).embeddings.create(model=MODEL_NAME, input=TEXTS)


async def test_the_nats_api_embeds_as_http_does(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    import json

    from openai.types import CreateEmbeddingResponse

    from shoal.bus.errors import RemoteError
    from shoal.bus.streams import request_stream
    from shoal.gateway.nats_api import NatsApi
    from shoal.gateway.serving import serving_context
    from tests.fixtures.api_schemas import check_schema

    model_dir = tiny_checkpoint("llama")
    app_options = {"embeddings": EmbeddingOptions()}
    async with served_stack(model_dir, app_options=app_options, runner="pooling") as served:
        client = served.stack.client
        api = NatsApi(
            client.bus,
            serving_context(client, served_model_name=MODEL_NAME, embeddings=EmbeddingOptions()),
        )
        await api.start()
        try:
            subject = api.subjects.api("embeddings")
            payload = json.dumps({"input": TEXTS}).encode()
            (reply,) = [
                json.loads(m.data)
                async for m in request_stream(client.bus, subject, payload, timeout=30)
            ]
            http = await client_of(served.url).embeddings.create(model=MODEL_NAME, input=TEXTS)
            assert [d["embedding"] for d in reply["data"]] == [d.embedding for d in http.data]
            # the published body, with vLLM's id and creation time besides
            check_schema(
                CreateEmbeddingResponse, reply, extensions=frozenset({"$.id", "$.created"})
            )
            with pytest.raises(RemoteError) as caught:
                bad = json.dumps({"input": TEXTS, "dimensions": 4}).encode()
                async for _ in request_stream(client.bus, subject, bad, timeout=30):
                    pass
            assert "matryoshka" in str(caught.value)
        finally:
            await api.stop()
        await served.wait_until_idle()
