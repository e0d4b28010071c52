"""SSE keep-alive: a stream that waits for output (here: queued behind a long request on an engine
that runs one sequence at a time) gets ``: keep-alive`` comments, then completes normally, and the
openai client reads it as if they were not there. An error after the keep-alive opened the stream
is an error event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from tests.integration.conditions import wait_for
from tests.integration.served_stack import ServedStack, served_stack, with_chat_template
from tests.unit.test_gateway_fake import FakeEngineClient, serve_gateway

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

KEEP_ALIVE_S = 0.05
KEEP_ALIVE_LINES = [b": keep-alive\n", b"\n"]
CMPL = "/v1/completions"
LONG = {"prompt": "the quick brown fox", "max_tokens": 900, "ignore_eos": True, "stream": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tiny_checkpoint, tmp_path_factory) -> AsyncIterator[ServedStack]:  # type: ignore[no-untyped-def]
    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path_factory.mktemp("m") / "m")
    async with served_stack(
        model_dir, app_options={"sse_keep_alive_s": KEEP_ALIVE_S}, max_num_seqs=1
    ) as stack:
        yield stack


@pytest_asyncio.fixture(loop_scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client_session:
        yield client_session


async def _start_long_request(
    served: ServedStack, session: aiohttp.ClientSession
) -> aiohttp.ClientResponse:
    """A long request that holds the engine's only sequence slot until it is dropped."""
    await served.wait_until_idle()
    ahead = await session.post(served.url + CMPL, json=LONG)
    assert ahead.status == 200
    await wait_for(lambda: len(served.scheduler.running) == 1, 10.0, "the long one running")
    return ahead


def _is_queued_behind(served: ServedStack) -> bool:
    """Two requests in the engine core: the long one running, another waiting."""
    scheduler = served.scheduler
    return len(scheduler.requests) == 2 and len(scheduler.running) == 1


async def test_a_queued_stream_gets_keep_alives_then_completes(
    served: ServedStack, session: aiohttp.ClientSession
) -> None:
    ahead = await _start_long_request(served, session)
    body = {"prompt": "hello", "max_tokens": 5, "ignore_eos": True, "stream": True}
    queued = await session.post(served.url + CMPL, json=body)  # headers come with a keep-alive
    assert queued.status == 200
    assert [await queued.content.readline() for _ in range(2)] == KEEP_ALIVE_LINES
    assert _is_queued_behind(served)  # nothing but a keep-alive can have opened the stream
    ahead.close()
    events = [e for e in (await queued.read()).split(b"\n\n") if e]
    data = [json.loads(e[len(b"data: ") :]) for e in events if e.startswith(b"data: {")]
    assert events[-1] == b"data: [DONE]"
    assert all(e.startswith((b"data: ", b": keep-alive")) for e in events)
    assert data[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"]) for c in data) >= 1
    await served.wait_until_idle()


async def test_the_openai_client_reads_a_stream_with_keep_alives(
    served: ServedStack, session: aiohttp.ClientSession
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
    common: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "stream": True}
    extra = {"ignore_eos": True}
    ahead = await _start_long_request(served, session)
    stream = await client.completions.create(**common, prompt="hello", extra_body=extra)
    assert _is_queued_behind(served)  # the stream opened on a keep-alive, before any output
    ahead.close()
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks)
    ahead = await _start_long_request(served, session)
    messages = [{"role": "user", "content": "hi"}]
    chat = await client.chat.completions.create(**common, messages=messages, extra_body=extra)
    assert _is_queued_behind(served)
    ahead.close()
    chat_chunks = [chunk async for chunk in chat]
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].choices[0].finish_reason == "length"
    await served.wait_until_idle()


async def test_an_error_after_a_keep_alive_is_an_error_event() -> None:
    engine = FakeEngineClient(token_delay=0.5)  # paces the fake's first (failing) step
    engine.fail_at_step = 0
    served = serve_gateway(engine, sse_keep_alive_s=0.01)
    async with served as (url, _), aiohttp.ClientSession() as session:
        body = {"prompt": "hi", "max_tokens": 3, "stream": True}
        async with session.post(url + CMPL, json=body) as response:
            assert response.status == 200
            events = [e for e in (await response.read()).split(b"\n\n") if e]
    assert events[0] == b": keep-alive"
    assert events[-1] == b"data: [DONE]"
    assert b'"engine_error"' in events[-2]
