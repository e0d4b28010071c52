"""The gateway over the real engine stack (worker, engine core, engine client; tiny random Llama,
in-memory bus): the openai client streaming and not, a disconnect and a stop string that end the
request in the engine core (freeing its KV blocks), and engine-core figures in /metrics."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.integration.conditions import (
    CONTEXT_LEN,
    assert_ended_by_abort,
    core_is_settled,
    pick_stop_string,
    wait_for,
)
from tests.integration.served_stack import complete, served_stack, with_chat_template

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
NUM_BLOCKS = 256  # engine_stack's default


async def test_openai_client_over_the_real_engine(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model")
    async with served_stack(model_dir) as served:
        url, stack = served.url, served.stack
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
    async with served_stack(tiny_checkpoint("llama")) as served:
        url, stack, metrics = served.url, served.stack, served.metrics
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
        await wait_for(lambda: core_is_settled(core), 120, "the victim leaves the core")
        assert_ended_by_abort(core.stats(), num_blocks=NUM_BLOCKS, max_tokens=room)
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
            text = await response.text()
    assert 'vllm:request_success_total{finished_reason="abort",model_name="tiny"} 1.0' in text
    assert 'vllm:num_requests_running{engine="e0",model_name="tiny"}' in text
    assert metrics.num_in_flight == 0


async def test_latency_histograms_fill_from_the_real_engine(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    async with served_stack(tiny_checkpoint("llama")) as served:
        url = served.url
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


async def test_stop_strings_end_the_request_in_the_engine_core(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The text is cut as vLLM cuts it (at the first occurrence, the string itself kept only with
    include_stop_str_in_output), streamed and not, and the engine core stops generating: the
    client aborts the request there once the string matches, far before max_tokens."""
    async with served_stack(tiny_checkpoint("llama")) as served:
        url, stack = served.url, served.stack
        core = stack.engines[0].core
        assert core is not None
        room = CONTEXT_LEN - len(stack.client.tokenizer.encode("a long story"))
        common = {"prompt": "a long story", "temperature": 0, "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            full = await complete(session, url, {**common, "max_tokens": 40})
            stop = pick_stop_string(full.text)
            cut = full.text.index(stop)
            for stream in (False, True):
                for include in (False, True):
                    before = core.stats()
                    body = {**common, "max_tokens": room, "stop": [stop], "stream": stream}
                    body["include_stop_str_in_output"] = include
                    got = await complete(session, url, body)
                    want = full.text[: cut + len(stop)] if include else full.text[:cut]
                    case = f"stream={stream} include={include}"
                    assert (got.text, got.finish_reason, got.stop_reason) == (want, "stop", stop)
                    assert got.num_chunks > 1 or not stream, case
                    await wait_for(lambda: core_is_settled(core), 60, case)
                    after = core.stats()
                    assert after.num_finished_abort == before.num_finished_abort + 1, case
                    assert after.num_finished_length == before.num_finished_length, case
                    generated = after.num_generation_tokens - before.num_generation_tokens
                    assert generated < room // 4, (case, generated)
                    assert after.num_free_blocks == NUM_BLOCKS - 1, case
