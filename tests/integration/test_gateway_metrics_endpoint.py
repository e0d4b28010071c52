"""``/metrics`` after a known mix of requests: vLLM's names, and counts that match what was sent."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal.gateway.metrics import Metrics
from tests.integration.conditions import wait_for
from tests.unit.test_gateway_fake import MODEL_NAME, FakeEngineClient, serve_gateway

pytestmark = pytest.mark.timeout(120)

EXPECTED_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count",
]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    key = (name, tuple(sorted({"model_name": MODEL_NAME, **labels}.items())))
    return samples[key]


async def test_metrics_count_the_requests_sent() -> None:
    engine = FakeEngineClient(eos_after=3)
    metrics = Metrics(MODEL_NAME, max_model_len=engine.max_model_len)
    engine.on_stats = metrics.update_engine_stats
    sent = [
        ("/v1/completions", {"prompt": "the fox", "max_tokens": 2}, "length", 2),
        ("/v1/completions", {"prompt": "the dog", "max_tokens": 2, "stream": True}, "length", 2),
        ("/v1/completions", {"prompt": "a river", "max_tokens": 9}, "stop", 4),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": True},
            "stop",
            4,
        ),
        (
            "/v1/completions",
            {"prompt": "the fox", "max_tokens": 2, "ignore_eos": True},
            "length",
            2,
        ),
    ]
    served = serve_gateway(engine, metrics=metrics)
    async with served as (url, _), aiohttp.ClientSession() as session:
        prompt_tokens = 0
        for path, body, _, _ in sent:
            async with session.post(url + path, json=body) as response:
                assert response.status == 200
                await response.read()
            if "prompt" in body:
                prompt_tokens += len(engine.tokenizer.encode(body["prompt"]))
            else:
                prompt_tokens += len(engine.encode_chat(body["messages"]))
        async with session.post(url + "/v1/completions", json={"prompt": 1}) as response:
            assert response.status == 400  # rejected requests are not counted
        async with session.get(url + "/metrics") as response:
            assert response.status == 200
            assert response.content_type == "text/plain"
            text = await response.text()
    samples = _samples(text)
    present = {name for name, _ in samples}
    assert [name for name in EXPECTED_NAMES if name not in present] == []
    num_generated = sum(tokens for *_, tokens in sent)
    assert _value(samples, "vllm:request_success_total", finished_reason="length") == 3
    assert _value(samples, "vllm:request_success_total", finished_reason="stop") == 2
    assert _value(samples, "vllm:request_success_total", finished_reason="abort") == 0
    assert _value(samples, "vllm:prompt_tokens_total") == prompt_tokens
    assert _value(samples, "vllm:generation_tokens_total") == num_generated
    assert _value(samples, "vllm:time_to_first_token_seconds_count") == len(sent)
    assert _value(samples, "vllm:e2e_request_latency_seconds_count") == len(sent)
    assert _value(samples, "vllm:request_queue_time_seconds_count") == len(sent)
    # the fake yields one token per output, so each request has tokens - 1 inter-token gaps
    assert _value(samples, "vllm:inter_token_latency_seconds_count") == num_generated - len(sent)
    assert _value(samples, "vllm:request_generation_tokens_sum") == num_generated
    assert _value(samples, "shoal:gateway_requests_in_flight") == 0
    assert _value(samples, "vllm:num_requests_running", engine="fake-0") == 1  # the last step's


async def test_aborted_requests_are_counted_as_abort() -> None:
    engine = FakeEngineClient(token_delay=0.01)
    metrics = Metrics(MODEL_NAME)
    async with serve_gateway(engine, metrics=metrics) as (url, _):
        session = aiohttp.ClientSession()
        body = {"prompt": "the fox", "max_tokens": 100, "stream": True}
        response = await session.post(url + "/v1/completions", json=body)
        await response.content.readline()
        assert metrics.num_in_flight == 1
        await session.close()  # the client goes away mid-stream
        await wait_for(
            lambda: not engine.in_flight and metrics.num_in_flight == 0, 5.0, "request aborted"
        )
        async with (
            aiohttp.ClientSession() as session,
            session.get(url + "/metrics") as metrics_response,
        ):
            samples = _samples(await metrics_response.text())
    assert _value(samples, "vllm:request_success_total", finished_reason="abort") == 1
    assert _value(samples, "shoal:gateway_requests_in_flight") == 0
