"""``gateway.metrics.Metrics``: request hooks and engine-stats counters, read back from the
Prometheus registry."""

from __future__ import annotations

from shoal.bus.messages.engine import SchedulerStats
from shoal.engine.client.outputs import CompletionOutput, RequestMetrics, RequestOutput
from shoal.gateway.metrics import Metrics, one_two_five_buckets


def _get(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})


def _output(index: int, tokens: list[int], finish: str | None, metrics=None) -> RequestOutput:  # type: ignore[no-untyped-def]
    completion = CompletionOutput(index, "x" * len(tokens), tokens, finish_reason=finish)
    return RequestOutput("r", None, [1, 2], [completion], finish is not None, metrics=metrics)


def test_request_lifecycle_counts_tokens_latencies_and_reasons() -> None:
    metrics = Metrics("m", max_model_len=100)
    timer = metrics.start_request(num_prompt_tokens=7, n=1, max_tokens=3, arrival_time=100.0)
    assert metrics.num_in_flight == 1
    metrics.observe_output(timer, _output(0, [5], None), now=100.5)
    metrics.observe_output(timer, _output(0, [6, 7], None), now=100.7)
    engine_times = RequestMetrics(100.0, 100.1, 100.5, 100.9, 101.0)
    metrics.observe_output(timer, _output(0, [], "length", engine_times), now=101.0)
    metrics.finish_request(timer, n=1, now=101.0)
    metrics.finish_request(timer, n=1, now=102.0)  # idempotent
    assert metrics.num_in_flight == 0
    assert _get(metrics, "vllm:prompt_tokens_total") == 7
    assert _get(metrics, "vllm:generation_tokens_total") == 3
    assert _get(metrics, "vllm:request_success_total", finished_reason="length") == 1
    assert _get(metrics, "vllm:time_to_first_token_seconds_sum") == 0.5
    assert _get(metrics, "vllm:inter_token_latency_seconds_count") == 1
    assert abs(_get(metrics, "vllm:inter_token_latency_seconds_sum") - 0.2) < 1e-9  # type: ignore[operator]
    assert _get(metrics, "vllm:e2e_request_latency_seconds_sum") == 1.0
    assert abs(_get(metrics, "vllm:request_queue_time_seconds_sum") - 0.1) < 1e-9  # type: ignore[operator]
    assert abs(_get(metrics, "vllm:request_decode_time_seconds_sum") - 0.5) < 1e-9  # type: ignore[operator]


def test_a_disaggregated_requests_ttft_split_into_handover_and_first_decode() -> None:
    """Queue and prefill on the prefill engine core (vLLM's histograms), then the handover to the
    decode engine core and its first step (the KV pull with it): shoal's two."""
    metrics = Metrics("m")
    for handed_over in (True, False):
        timer = metrics.start_request(num_prompt_tokens=7, n=1, max_tokens=3, arrival_time=100.0)
        times = RequestMetrics(100.0, 100.1, 100.5, 101.4, 101.5)
        if handed_over:
            times.handover_time, times.decode_scheduled_time = 100.5, 100.75
            times.decode_first_token_time = 101.0
        metrics.observe_output(timer, _output(0, [5, 6, 7], "length", times), now=101.5)
        metrics.finish_request(timer, n=1, now=101.5)
    assert abs(_get(metrics, "vllm:request_prefill_time_seconds_sum") - 0.8) < 1e-9  # type: ignore[operator]
    assert _get(metrics, "shoal:request_handover_time_seconds_count") == 1
    assert _get(metrics, "shoal:request_handover_time_seconds_sum") == 0.25
    assert _get(metrics, "shoal:request_first_decode_time_seconds_sum") == 0.25


def test_unfinished_choices_count_as_aborted() -> None:
    metrics = Metrics("m")
    timer = metrics.start_request(num_prompt_tokens=2, n=3, max_tokens=None)
    metrics.observe_output(timer, _output(1, [4], "stop"))
    metrics.finish_request(timer, n=3)
    assert _get(metrics, "vllm:request_success_total", finished_reason="abort") == 2
    assert _get(metrics, "vllm:request_success_total", finished_reason="stop") == 1
    assert _get(metrics, "shoal:gateway_requests_in_flight") == 0


def test_engine_stats_gauges_and_cumulative_counters() -> None:
    metrics = Metrics("m")
    metrics.update_engine_stats(SchedulerStats(3, 1, 0.5, 100, 40, 2), "e0")
    metrics.update_engine_stats(SchedulerStats(2, 0, 0.25, 150, 70, 2), "e0")
    metrics.update_engine_stats(SchedulerStats(1, 0, 0.1, 10, 5, 1), "e1")
    labels = {"engine": "e0"}
    assert _get(metrics, "vllm:num_requests_running", **labels) == 2
    assert _get(metrics, "vllm:kv_cache_usage_perc", **labels) == 0.25
    assert _get(metrics, "vllm:prefix_cache_queries_total", **labels) == 150
    assert _get(metrics, "vllm:prefix_cache_hits_total", **labels) == 70
    assert _get(metrics, "vllm:num_preemptions_total", **labels) == 2
    metrics.update_engine_stats(SchedulerStats(0, 0, 0.0, 20, 10, 0), "e0")  # restarted
    assert _get(metrics, "vllm:prefix_cache_queries_total", **labels) == 170


def test_token_buckets() -> None:
    assert one_two_five_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert one_two_five_buckets(4) == [1, 2]


def test_two_gateways_in_one_process_have_separate_registries() -> None:
    first, second = Metrics("m"), Metrics("m")
    first.prompt_tokens.labels("m").inc(3)
    assert _get(second, "vllm:prompt_tokens_total") == 0


def test_out_of_order_stats_are_ignored_but_restarts_count() -> None:
    metrics = Metrics("m")
    metrics.update_engine_stats(SchedulerStats(4, 0, 0.5, 100, 50, step_id=10), "e0")
    metrics.update_engine_stats(SchedulerStats(9, 0, 0.9, 90, 40, step_id=9), "e0")  # late
    assert _get(metrics, "vllm:num_requests_running", engine="e0") == 4
    assert _get(metrics, "vllm:prefix_cache_queries_total", engine="e0") == 100
    metrics.update_engine_stats(SchedulerStats(1, 0, 0.1, 30, 10, step_id=2), "e0")  # restarted
    assert _get(metrics, "vllm:prefix_cache_queries_total", engine="e0") == 130
    assert _get(metrics, "vllm:num_requests_running", engine="e0") == 1
