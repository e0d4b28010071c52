"""The gateway over the real engine stack (worker, engine core, engine client; tiny random Llama,
in-memory bus): the openai client streaming and not, a disconnect that frees the request's KV
blocks in the engine core, and engine-core figures in /metrics."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest

from shoal.bus.memory import InMemoryBus
from shoal.gateway.app import create_app
from shoal.gateway.metrics import Metrics
from shoal.gateway.server import start_http_server
from tests.integration.conditions import CONTEXT_LEN, assert_ended_by_abort, wait_for
from tests.integration.engine_stack import EngineStack, engine_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
NUM_BLOCKS = 256  # engine_stack's default
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def _with_chat_template(model_dir: Path, out_dir: Path) -> Path:
    from transformers import AutoTokenizer

    shutil.copytree(model_dir, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


@contextlib.asynccontextmanager
async def served_stack(model_dir: Path) -> AsyncIterator[tuple[str, EngineStack, Metrics]]:
    bus = InMemoryBus()
    await bus.connect()
    try:
        async with engine_stack(bus, model_dir) as stack:
            metrics = Metrics("tiny", max_model_len=stack.client.max_model_len)
            stack.client.stats_listeners.append(metrics.update_engine_stats)
            app = create_app(stack.client, served_model_name="tiny", metrics=metrics)
            server = await start_http_server(app)
            try:
                yield server.url, stack, metrics
            finally:
                await server.stop()
    finally:
        await bus.close()


async def test_openai_client_over_the_real_engine(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_dir = _with_chat_template(tiny_checkpoint("llama"), tmp_path / "model")
    async with served_stack(model_dir) as (url, stack, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        common = {"model": "tiny", "prompt": "a long story", "max_tokens": 10, "temperature": 0}
        whole = await client.completions.create(**common, extra_body={"ignore_eos": True})
        stream = await client.completions.create(
            **common,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
        messages = [{"role": "user", "content": "hello world"}]
        chat = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        chat_stream = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chat_chunks = [chunk async for chunk in chat_stream]
        prompt_len = len(stack.client.tokenizer.encode("a long story"))
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10 and whole.usage.prompt_tokens == prompt_len
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    reasons = [c.choices[0].finish_reason for c in text_chunks]
    assert reasons[-1] == "length" and reasons.count("length") == 1
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    joined = "".join(c.choices[0].delta.content or "" for c in chat_chunks)
    assert joined == chat.choices[0].message.content
    assert chat.usage.completion_tokens == 6


async def test_disconnect_frees_the_request_in_the_engine_core(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The victim could only end by abort: no eos, and room for ~1000 more tokens."""
    async with served_stack(tiny_checkpoint("llama")) as (url, stack, metrics):
        core = stack.engines[0].core
        assert core is not None
        room = CONTEXT_LEN - len(stack.client.tokenizer.encode("a long story"))
        body = {"prompt": "a long story", "max_tokens": room, "ignore_eos": True, "stream": True}
        session = aiohttp.ClientSession()
        response = await session.post(url + "/v1/completions", json=body)
        for _ in range(3):
            assert (await response.content.readline()).startswith(b"data: ")
            await response.content.readline()
        assert core.scheduler.requests and core.scheduler.kv_cache_manager.usage > 0
        await session.close()  # the client goes away mid-stream
        await wait_for(lambda: not core.scheduler.requests, 120, "the victim leaves the core")
        assert_ended_by_abort(core.stats(), num_blocks=NUM_BLOCKS, max_tokens=room)
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
            text = await response.text()
    assert 'vllm:request_success_total{finished_reason="abort",model_name="tiny"} 1.0' in text
    assert 'vllm:num_requests_running{engine="e0",model_name="tiny"}' in text
    assert metrics.num_in_flight == 0


async def test_latency_histograms_fill_from_the_real_engine(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    async with served_stack(tiny_checkpoint("llama")) as (url, _, _):
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                async with session.post(url + "/v1/completions", json=body) as response:
                    assert response.status == 200
            async with session.get(url + "/metrics") as response:
                text = await response.text()
    for name in (
        "request_queue_time_seconds",
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_prefill_time_seconds",
    ):
        assert f'vllm:{name}_count{{model_name="tiny"}} 3.0' in text, name
