"""Prometheus metrics with vLLM's names, so existing vLLM dashboards work unchanged.

Two sources feed them:
- the gateway's own requests (``start_request`` → ``observe_output`` per engine output →
  ``finish_request``): token counters, request success by finish reason, TTFT, inter-token,
  end-to-end and (when the engine reports timestamps) queue/prefill/decode histograms;
- engine-core statistics (``update_engine_stats``, connected by whoever owns the engine client):
  running/waiting gauges, KV usage, and prefix-cache/preemption/KV offload/disaggregated
  prefill (holds, pulls) counters derived
  from the cumulative figures each engine core reports (every series from the first report
  on, at 0 where a core has no offload), and speculative decoding's counters when the
  deployment speculates (``spec_decode_metrics``);
- engine-core status changes (``observe_engine_status``, fed by the engine client's
  fault-tolerance API): the status gauge, and the faults (into UNHEALTHY or DEAD) and
  recoveries (back to healthy after a fault) this gateway saw of each engine core;
- the KV offload tiers' heartbeats (``tiering.update_tier``): ``vllm:kv_offload_tiering_*``
  per tier (``tiering_metrics``).

Outputs are expected in DELTA form (``token_ids`` holds only new tokens), as the gateway asks.
Each ``Metrics`` has its own registry, so several gateways may live in one process (tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from shoal.bus.messages.engine import SchedulerStats
from shoal.engine.client.outputs import RequestMetrics, RequestOutput
from shoal.gateway.spec_decode_metrics import SpecDecodeMetrics, increment
from shoal.gateway.tiering_metrics import TieringMetrics

# Bucket bounds (seconds) as vLLM has them.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0]
TTFT_BUCKETS += [7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0]
ITL_BUCKETS += [7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0]
LATENCY_BUCKETS += [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort", "error")
# shoal:engine_status values: vLLM's EngineStatusType (healthy 0, dead 1, unhealthy 2), then
# shoal's own states an engine core passes through.
ENGINE_STATUS_VALUES = {"healthy": 0, "dead": 1, "unhealthy": 2, "starting": 3, "draining": 4}
FAULTED = ("dead", "unhealthy")
# KV offload counters of SchedulerStats (name, help, field), under vLLM's OffloadingConnector
# names (seconds in ``*_time``, as vLLM has them); lookup failures are shoal's own.
OFFLOAD_COUNTERS = (
    ("vllm:kv_offload_queries", "Tokens looked up in the KV offload tiers", "kv_offload_queries"),
    ("vllm:kv_offload_hits", "Tokens found in the KV offload tiers", "kv_offload_hits"),
    ("vllm:kv_offload_load_bytes", "Bytes loaded from the offload tiers", "kv_offload_load_bytes"),
    ("vllm:kv_offload_load_time", "Seconds loading from the tiers", "kv_offload_load_time_s"),
    ("vllm:kv_offload_store_bytes", "Bytes stored to the tiers", "kv_offload_store_bytes"),
    ("vllm:kv_offload_store_time", "Seconds storing to the tiers", "kv_offload_store_time_s"),
    ("vllm:kv_offload_stores_skipped", "Chunk stores dropped", "kv_offload_stores_skipped"),
    (
        "shoal:kv_offload_lookup_failures",
        "Offload lookups failed or timed out (the request recomputed)",
        "kv_offload_lookup_failures",
    ),
)
# Disaggregated prefill's counters of SchedulerStats: the prefill side's holds, the decode
# side's pulls (vLLM's NIXL connector counts failed transfers under this name; the rest are
# shoal's own).
DISAGG_COUNTERS = (
    ("shoal:kv_handover_holds", "Prompt KV holds made for remote decodes", "kv_handover_holds"),
    ("shoal:kv_handover_released", "Holds released by their decode side", "kv_handover_released"),
    ("shoal:kv_handover_expired", "Holds ended by their lease", "kv_handover_expired"),
    ("shoal:kv_pulls", "Remote prefills' KV pulled", "kv_pulls"),
    ("vllm:nixl_num_failed_transfers", "KV pulls failed (recomputed)", "kv_pull_failures"),
    ("shoal:kv_pulled_tokens", "Prompt tokens pulled from prefill engines", "kv_pulled_tokens"),
    (
        "shoal:kv_pull_recomputed_tokens",
        "Prompt tokens of failed pulls, recomputed instead",
        "kv_pull_recomputed_tokens",
    ),
    ("shoal:kv_pull_bytes", "Bytes pulled from prefill engines' KV caches", "kv_pull_bytes"),
    ("shoal:kv_pull_seconds", "Seconds the workers spent pulling", "kv_pull_time_s"),
    (
        "shoal:kv_pull_late",
        "Remote prefills admitted too late to pull (recomputed)",
        "kv_pull_late",
    ),
)
CONTENT_TYPE = CONTENT_TYPE_LATEST


def one_two_five_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > limit:
                return buckets
            buckets.append(float(value))
        scale *= 10


@dataclass(slots=True)
class RequestTimer:
    """What the gateway saw of one engine request (one prompt, ``n`` completions)."""

    arrival_time: float
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: dict[int, float] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    engine_metrics: RequestMetrics | None = None
    finished: bool = False


class Metrics:
    """The gateway's Prometheus registry and the hooks that feed it."""

    def __init__(
        self,
        model_name: str,
        *,
        max_model_len: int = 8192,
        num_speculative_tokens: int = 0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """``num_speculative_tokens``: the deployment's K (0: it does not speculate, and the
        ``vllm:spec_decode_*`` series are not defined)."""
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._last_stats: dict[str, SchedulerStats] = {}
        self._faulted: dict[str, bool] = {}  # engine id → in a fault (not yet recovered)
        self.num_in_flight = 0  # engine requests started and not finished (also a gauge)
        self._define_request_metrics(max_model_len)
        self._define_engine_metrics()
        self.spec_decode = (
            SpecDecodeMetrics(self.registry, num_speculative_tokens)
            if num_speculative_tokens > 0
            else None
        )
        self.tiering = TieringMetrics(self.registry, model_name)  # fed by tier heartbeats
        # Every per-model series exists from the start (at 0), as vLLM exports them.
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        per_model: list[MetricWrapperBase] = [
            self.prompt_tokens,
            self.generation_tokens,
            self.prompt_tokens_cached,
        ]
        per_model += [*self.histograms.values(), self.request_prompt_tokens]
        per_model += [self.request_generation_tokens, self.request_params_n]
        per_model += [self.request_params_max_tokens, self.requests_in_flight]
        for metric in per_model:
            metric.labels(model_name)

    def _counter(self, name: str, doc: str, labels: list[str]) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: list[str]) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: list[float]) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)

    def _define_request_metrics(self, max_model_len: int) -> None:
        lm = ["model_name"]
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens", lm)
        self.generation_tokens = self._counter("vllm:generation_tokens", "Generated tokens", lm)
        self.prompt_tokens_cached = self._counter(
            "vllm:prompt_tokens_cached", "Prompt tokens from the prefix cache", lm
        )
        self.request_success = self._counter(
            "vllm:request_success", "Finished requests", [*lm, "finished_reason"]
        )
        hist = {
            "ttft": ("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS),
            "itl": ("vllm:inter_token_latency_seconds", "Inter-token latency", ITL_BUCKETS),
            "e2e": ("vllm:e2e_request_latency_seconds", "End-to-end latency", LATENCY_BUCKETS),
            "queue": ("vllm:request_queue_time_seconds", "Time in queue", LATENCY_BUCKETS),
            "inference": ("vllm:request_inference_time_seconds", "Time running", LATENCY_BUCKETS),
            "prefill": ("vllm:request_prefill_time_seconds", "Prefill time", LATENCY_BUCKETS),
            "decode": ("vllm:request_decode_time_seconds", "Decode time", LATENCY_BUCKETS),
            # Disaggregated prefill, after the queue and prefill on the prefill engine core:
            "handover": (
                "shoal:request_handover_time_seconds",
                "From the prefill's first token to the decode engine core admitting the request",
                TTFT_BUCKETS,
            ),
            "first_decode": (
                "shoal:request_first_decode_time_seconds",
                "From the decode engine core admitting the request to its first token (KV pull "
                "and first step)",
                TTFT_BUCKETS,
            ),
        }
        self.histograms = {key: self._histogram(*spec) for key, spec in hist.items()}
        tokens = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = self._histogram("vllm:request_prompt_tokens", "Prompt", tokens)
        self.request_generation_tokens = self._histogram(
            "vllm:request_generation_tokens", "Output tokens", tokens
        )
        self.request_params_n = self._histogram("vllm:request_params_n", "n", [1, 2, 5, 10, 20])
        self.request_params_max_tokens = self._histogram(
            "vllm:request_params_max_tokens", "max_tokens", tokens
        )
        self.requests_in_flight = self._gauge(
            "shoal:gateway_requests_in_flight", "Engine requests this gateway streams", lm
        )

    def _define_engine_metrics(self) -> None:
        le = ["model_name", "engine"]
        self.num_requests_running = self._gauge("vllm:num_requests_running", "Running", le)
        self.num_requests_waiting = self._gauge("vllm:num_requests_waiting", "Waiting", le)
        self.kv_cache_usage = self._gauge("vllm:kv_cache_usage_perc", "KV cache usage 0..1", le)
        self.prefix_cache_queries = self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queried tokens", le
        )
        self.prefix_cache_hits = self._counter("vllm:prefix_cache_hits", "Prefix cache hits", le)
        self.num_preemptions = self._counter("vllm:num_preemptions", "Preemptions", le)
        self.steps_in_flight = self._gauge(
            "shoal:engine_steps_in_flight", "Steps sent to the workers, result not applied", le
        )
        self.worker_idle = self._counter(
            "shoal:worker_idle_seconds",
            "Worker idle time between steps while its engine core had work (worker-measured)",
            le,
        )
        self.worker_execute = self._counter(
            "shoal:worker_execute_seconds", "Worker time executing steps", le
        )

        self.engine_status = self._gauge(
            "shoal:engine_status",
            "Engine core status: 0 healthy, 1 dead, 2 unhealthy, 3 starting, 4 draining",
            le,
        )
        self.engine_faults = self._counter(
            "shoal:engine_faults", "Engine core faults seen (into unhealthy or dead)", le
        )
        self.engine_recoveries = self._counter(
            "shoal:engine_recoveries", "Engine core recoveries seen (healthy after a fault)", le
        )
        self.kv_offload_usage = self._gauge(
            "vllm:kv_offload_cpu_cache_usage_perc", "KV offload CPU tier usage 0..1", le
        )
        self.engine_counters: list[tuple[Counter, str]] = [
            (self.prefix_cache_queries, "prefix_cache_queries"),
            (self.prefix_cache_hits, "prefix_cache_hits"),
            (self.num_preemptions, "num_preemptions"),
            (self.worker_idle, "worker_idle_s"),
            (self.worker_execute, "worker_execute_s"),
        ]
        self.engine_counters += [
            (self._counter(n, d, le), a) for n, d, a in (*OFFLOAD_COUNTERS, *DISAGG_COUNTERS)
        ]
        self.kv_handover_holding = self._gauge(
            "shoal:kv_handover_holding", "Prompt KV held for remote decodes now", le
        )
        # vLLM's: one series per engine core, labelled with its adapters, valued the time seen
        self.lora_requests_info = self._gauge(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests",
            [*le, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        self._lora_labels: dict[str, tuple[str, ...]] = {}

    # --- requests ---------------------------------------------------------------------------

    def start_request(
        self,
        *,
        num_prompt_tokens: int,
        n: int,
        max_tokens: int | None,
        arrival_time: float | None = None,
    ) -> RequestTimer:
        self.num_in_flight += 1
        self.requests_in_flight.labels(self.model_name).inc()
        self.request_params_n.labels(self.model_name).observe(n)
        if max_tokens is not None:
            self.request_params_max_tokens.labels(self.model_name).observe(max_tokens)
        arrival = time.time() if arrival_time is None else arrival_time
        return RequestTimer(arrival_time=arrival, num_prompt_tokens=num_prompt_tokens)

    def observe_output(
        self, timer: RequestTimer, output: RequestOutput, now: float | None = None
    ) -> None:
        """One (DELTA) output of the request: first-token and inter-token latencies."""
        now = time.time() if now is None else now
        if output.metrics is not None:
            timer.engine_metrics = output.metrics
        timer.num_cached_tokens = max(timer.num_cached_tokens, output.num_cached_tokens)
        for completion in output.outputs:
            if completion.token_ids:
                timer.num_generation_tokens += len(completion.token_ids)
                self._observe_token_times(timer, completion.index, now)
            if completion.finish_reason is not None:
                timer.finish_reasons[completion.index] = completion.finish_reason

    def _observe_token_times(self, timer: RequestTimer, index: int, now: float) -> None:
        if timer.first_token_time is None:
            timer.first_token_time = now
            self.histograms["ttft"].labels(self.model_name).observe(now - timer.arrival_time)
        previous = timer.last_token_time.get(index)
        if previous is not None:
            self.histograms["itl"].labels(self.model_name).observe(now - previous)
        timer.last_token_time[index] = now

    def finish_request(self, timer: RequestTimer, n: int, now: float | None = None) -> None:
        """Count the request as done; completions with no finish reason count as aborted."""
        if timer.finished:
            return
        timer.finished = True
        now = time.time() if now is None else now
        name = self.model_name
        self.num_in_flight -= 1
        self.requests_in_flight.labels(name).dec()
        for index in range(n):
            reason = timer.finish_reasons.get(index, "abort")
            self.request_success.labels(name, reason).inc()
        self.prompt_tokens.labels(name).inc(timer.num_prompt_tokens)
        self.prompt_tokens_cached.labels(name).inc(timer.num_cached_tokens)
        self.generation_tokens.labels(name).inc(timer.num_generation_tokens)
        self.request_prompt_tokens.labels(name).observe(timer.num_prompt_tokens)
        self.request_generation_tokens.labels(name).observe(timer.num_generation_tokens)
        self.histograms["e2e"].labels(name).observe(now - timer.arrival_time)
        self._observe_engine_times(timer.engine_metrics)

    def _observe_engine_times(self, m: RequestMetrics | None) -> None:
        if m is None or m.first_scheduled_time is None:
            return
        name, h = self.model_name, self.histograms
        h["queue"].labels(name).observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.first_token_time is not None:
            h["prefill"].labels(name).observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.finished_time is not None:
            h["inference"].labels(name).observe(max(0.0, m.finished_time - m.first_scheduled_time))
            if m.first_token_time is not None:
                h["decode"].labels(name).observe(max(0.0, m.finished_time - m.first_token_time))
        if m.handover_time is not None and m.decode_scheduled_time is not None:
            h["handover"].labels(name).observe(max(0.0, m.decode_scheduled_time - m.handover_time))
            if m.decode_first_token_time is not None:
                first_decode = m.decode_first_token_time - m.decode_scheduled_time
                h["first_decode"].labels(name).observe(max(0.0, first_decode))

    # --- engine cores -----------------------------------------------------------------------

    def update_engine_stats(self, stats: SchedulerStats, engine_id: str) -> None:
        """An engine core's latest figures. Its counters are cumulative: a drop means the core
        restarted, and the new value counts as fresh increments. Figures of an older step than
        the last seen arrived out of order (stats travel on two subjects) and are ignored, unless
        the step number fell by more than half: then the core restarted."""
        last = self._last_stats.get(engine_id)
        if last is not None and stats.step_id < last.step_id:
            if stats.step_id * 2 >= last.step_id:
                return
            last = None
        labels = (self.model_name, engine_id)
        self.num_requests_running.labels(*labels).set(stats.num_running)
        self.num_requests_waiting.labels(*labels).set(stats.num_waiting)
        self.kv_cache_usage.labels(*labels).set(stats.kv_usage)
        self.steps_in_flight.labels(*labels).set(stats.num_steps_in_flight)
        self.kv_offload_usage.labels(*labels).set(stats.kv_offload_cpu_usage)
        self.kv_handover_holding.labels(*labels).set(stats.kv_handover_holding)
        for counter, attr in self.engine_counters:
            value = getattr(stats, attr)
            previous = getattr(last, attr) if last is not None else 0
            counter.labels(*labels).inc(increment(value, previous))
        if self.spec_decode is not None:
            self.spec_decode.update(stats, last, labels)
        if stats.max_loras:
            self._update_lora_info(stats, labels)
        self._last_stats[engine_id] = stats

    def _update_lora_info(self, stats: SchedulerStats, labels: tuple[str, str]) -> None:
        """The engine core's series of ``vllm:lora_requests_info`` (its last one replaced)."""
        lora = (
            *labels,
            str(stats.max_loras),
            ",".join(stats.lora_running),
            ",".join(stats.lora_waiting),
        )
        previous = self._lora_labels.get(labels[1])
        if previous is not None and previous != lora:
            self.lora_requests_info.remove(*previous)
        self.lora_requests_info.labels(*lora).set(time.time())
        self._lora_labels[labels[1]] = lora

    def observe_engine_status(self, engine_id: str, status: str) -> None:
        """An engine core's new status (``fault.status_name``): a fault when it enters
        unhealthy or dead, a recovery when it is healthy again after one."""
        labels = (self.model_name, engine_id)
        self.engine_status.labels(*labels).set(ENGINE_STATUS_VALUES.get(status, -1))
        faults, recoveries = (
            self.engine_faults.labels(*labels),
            self.engine_recoveries.labels(*labels),
        )
        was_faulted = self._faulted.get(engine_id, False)
        if status in FAULTED and not was_faulted:
            faults.inc()
            self._faulted[engine_id] = True
        elif status == "healthy" and was_faulted:
            recoveries.inc()
            self._faulted[engine_id] = False

    def render(self) -> bytes:
        return generate_latest(self.registry)
