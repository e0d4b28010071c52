"""The official ``openai`` client against a served gateway (fake engine): streaming and not,
completions and chat, n>1, batches, token-id prompts, echo, logprobs, usage, concurrency."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import openai
import pytest

from tests.unit.test_gateway_fake import MODEL_NAME, FakeEngineClient, serve_gateway

pytestmark = pytest.mark.timeout(120)


def _client(url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=30)


async def _stream_completion(client: openai.AsyncOpenAI, **kwargs):
    """Joined text per choice, finish reasons per choice (in order), the usage chunk, chunks."""
    stream = await client.completions.create(model=MODEL_NAME, stream=True, **kwargs)
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[tuple[int, str]]] = defaultdict(list)
    chunks = [chunk async for chunk in stream]
    usage = None
    for number, chunk in enumerate(chunks):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finishes[choice.index].append((number, choice.finish_reason))
    return texts, finishes, usage, chunks


def _last_chunk_of(chunks, index: int) -> int:
    return max(n for n, chunk in enumerate(chunks) for c in chunk.choices if c.index == index)


async def test_completion_stream_matches_non_stream() -> None:
    async with serve_gateway() as (url, engine):
        client = _client(url)
        whole = await client.completions.create(
            model=MODEL_NAME, prompt="the quick fox", max_tokens=9
        )
        texts, finishes, usage, chunks = await _stream_completion(
            client, prompt="the quick fox", max_tokens=9, stream_options={"include_usage": True}
        )
    assert whole.choices[0].text and texts[0] == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length"
    assert finishes[0] == [(_last_chunk_of(chunks, 0), "length")]  # once, on the last chunk
    prompt_len = len(engine.tokenizer.encode("the quick fox"))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_len, 9)
    assert whole.usage.total_tokens == prompt_len + 9
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])


async def test_chat_stream_matches_non_stream_role_first() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a fox"}]
    async with serve_gateway() as (url, engine):
        client = _client(url)
        whole = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=7
        )
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""
    assert all(c.delta.role is None for chunk in chunks[1:] for c in chunk.choices)
    joined = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    assert joined == message.content
    reasons = [
        (n, c.finish_reason) for n, ch in enumerate(chunks) for c in ch.choices if c.finish_reason
    ]
    assert reasons == [(len(chunks) - 2, "length")]  # the last choice chunk; then the usage chunk
    prompt_ids = engine.encode_chat(messages)
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == 7
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


async def test_n_and_batch_prompts_streaming_and_not() -> None:
    prompts = ["the quick fox", "a small model"]
    async with serve_gateway() as (url, _):
        client = _client(url)
        whole = await client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, n=3)
        texts, finishes, _, chunks = await _stream_completion(
            client, prompt=prompts, max_tokens=5, n=3
        )
    assert [c.index for c in whole.choices] == list(range(6))
    assert {i: c.text for i, c in enumerate(whole.choices)} == dict(texts)
    assert len({c.text for c in whole.choices}) == 6  # the choices differ
    for index in range(6):
        assert finishes[index] == [(_last_chunk_of(chunks, index), "length")]
    assert whole.usage.completion_tokens == 30


async def test_token_id_prompts_and_echo() -> None:
    async with serve_gateway() as (url, engine):
        ids = engine.tokenizer.encode("the lazy dog")
        client = _client(url)
        by_text = await client.completions.create(
            model=MODEL_NAME, prompt="the lazy dog", max_tokens=4
        )
        by_ids = await client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4)
        batch = await client.completions.create(model=MODEL_NAME, prompt=[ids, ids], max_tokens=4)
        echoed = await client.completions.create(
            model=MODEL_NAME, prompt="the lazy dog", max_tokens=4, echo=True
        )
        texts, _, _, _ = await _stream_completion(client, prompt=ids, max_tokens=4, echo=True)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.text for c in batch.choices] == [by_text.choices[0].text] * 2
    assert echoed.choices[0].text == "the lazy dog" + by_text.choices[0].text
    assert texts[0] == "the lazy dog" + by_text.choices[0].text
    assert echoed.usage.completion_tokens == 4


async def test_completion_logprobs_shape() -> None:
    async with serve_gateway() as (url, engine):
        client = _client(url)
        result = await client.completions.create(
            model=MODEL_NAME, prompt="the fox", max_tokens=4, logprobs=3
        )
        echoed = await client.completions.create(
            model=MODEL_NAME, prompt="the fox", max_tokens=4, logprobs=2, echo=True
        )
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == result.choices[0].text
    assert all(v == -0.5 for v in lp.token_logprobs)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    prompt_len = len(engine.tokenizer.encode("the fox"))
    elp = echoed.choices[0].logprobs
    assert len(elp.tokens) == prompt_len + 4
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert "".join(elp.tokens) == echoed.choices[0].text


async def test_chat_logprobs_shape_streaming_and_not() -> None:
    messages = [{"role": "user", "content": "the fox"}]
    async with serve_gateway() as (url, _):
        client = _client(url)
        whole = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=3, logprobs=True, top_logprobs=2
        )
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=3,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
        streamed = [c async for chunk in stream for c in chunk.choices if c.logprobs]
    content = whole.choices[0].logprobs.content
    assert len(content) == 3 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert "".join(entry.token for entry in content) == whole.choices[0].message.content
    assert content[0].bytes == list(content[0].token.encode())
    tokens = [entry.token for c in streamed for entry in c.logprobs.content]
    assert tokens == [entry.token for entry in content]


async def test_stop_strings_seed_and_models() -> None:
    async with serve_gateway() as (url, _):
        client = _client(url)
        full = (
            await client.completions.create(model=MODEL_NAME, prompt="the", max_tokens=8)
        ).choices[0]
        stop = full.text.split()[4]
        cut = await client.completions.create(
            model=MODEL_NAME, prompt="the", max_tokens=8, stop=stop
        )
        texts, finishes, _, _ = await _stream_completion(
            client, prompt="the", max_tokens=8, stop=[stop]
        )
        models = await client.models.list()
    assert cut.choices[0].text == full.text[: full.text.index(stop)] == texts[0]
    assert cut.choices[0].finish_reason == "stop" and finishes[0][0][1] == "stop"
    assert [m.id for m in models.data] == [MODEL_NAME]


async def test_64_concurrent_streaming_clients() -> None:
    prompts = [f"the fox number {i}" for i in range(64)]
    async with serve_gateway(FakeEngineClient(token_delay=0.001)) as (url, engine):
        client = _client(url)
        expected = await asyncio.gather(
            *(
                client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8)
                for p in prompts[:4]
            )
        )
        results = await asyncio.wait_for(
            asyncio.gather(*(_stream_completion(client, prompt=p, max_tokens=8) for p in prompts)),
            timeout=90,
        )
    for i, whole in enumerate(expected):
        assert results[i][0][0] == whole.choices[0].text
    for texts, finishes, _, chunks in results:
        assert len(texts[0].split()) == 8 and finishes[0] == [(_last_chunk_of(chunks, 0), "length")]
    assert not engine.in_flight and not engine.aborted
