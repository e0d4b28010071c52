"""Traces across actors (``--otlp-traces-endpoint``), collected by an in-process OTLP receiver:
a request is one trace from the gateway through the engine client, the engine core (its queue,
each step it joined and that step's scheduling) and the workers that ran those steps, every
span under the right parent; a resumed request's trace shows both engine cores it ran on; a
caller's unsampled context records nothing; with tracing off nothing is exported and
OpenTelemetry is never imported."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from collections import Counter
from typing import Any

import aiohttp
import msgspec
import pytest

from shoal.bus.streams import request_stream
from shoal.config.observability import ObservabilityConfig
from shoal.gateway.nats_api import NatsApi
from shoal.gateway.serving import serving_context
from shoal.tracing.setup import actor_tracer, close_tracer
from tests.fixtures.otlp_receiver import GrpcReceiver, HttpReceiver, ReceivedSpan
from tests.integration.conditions import wait_for, wait_http_ready
from tests.integration.engine_stack import engine_stack
from tests.integration.serve_process import REPO, Server
from tests.integration.test_resumption import MAX_TOKENS, PROMPTS, Stream, busiest

pytestmark = pytest.mark.timeout(300)
HTTP_EXPORT = {
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    "OTEL_BSP_SCHEDULE_DELAY": "100",
}


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A collector the actors of this process export to over OTLP/HTTP, every 100 ms."""
    for name, value in HTTP_EXPORT.items():
        monkeypatch.setenv(name, value)
    receiver = HttpReceiver()
    yield receiver
    receiver.close()


def traceparent(sampled: bool = True) -> tuple[str, str, str]:
    """A caller's context: (trace id, span id, the traceparent header)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def children(spans: list[ReceivedSpan], parent: ReceivedSpan, name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_span_id == parent.span_id and s.name == name]


def only(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def within(child: ReceivedSpan, parent: ReceivedSpan) -> bool:
    return parent.start_ns <= child.start_ns <= child.end_ns <= parent.end_ns


def check_engine_request(spans: list[ReceivedSpan], request: ReceivedSpan) -> list[ReceivedSpan]:
    """An engine core's span of a request: its queue span, the schedule span under its first
    step, and per step one worker span (of that step, inside it, unless a fault abandoned the
    step); its steps, in order."""
    assert request.service == "shoal-engine" and request.kind == "consumer"
    queue = children(spans, request, "engine_core.queue")
    assert len(queue) == 1 and within(queue[0], request)
    steps = sorted(children(spans, request, "engine_core.step"), key=lambda s: s.start_ns)
    assert steps and queue[0].end_ns <= steps[0].start_ns
    (schedule,) = children(spans, steps[0], "engine_core.schedule")
    assert within(schedule, steps[0])
    for step in steps:
        assert within(step, request)
        assert step is steps[0] or not children(spans, step, "engine_core.schedule")
        executed = children(spans, step, "worker.execute")
        if step.failed:  # abandoned by a fault: its worker may not have run it, or run past it
            assert step.status_message == "the step was abandoned (a fault)"
            assert len(executed) <= 1
            continue
        (execute,) = executed
        assert within(execute, step)
        assert execute.service == "shoal-worker" and execute.kind == "consumer"
        assert execute.attributes["shoal.step.id"] == step.attributes["shoal.step.id"]
    return steps


# ----- one process, both buses


async def test_a_resumed_request_traces_both_engine_cores_it_ran_on(
    bus_factory: Any, tiny_checkpoint: Any, receiver: HttpReceiver
) -> None:
    bus = await bus_factory()
    ft = {"request_resume_timeout_s": 30.0}
    options = {"otlp_traces_endpoint": receiver.endpoint, "fault_tolerance_config": ft}
    model_dir = tiny_checkpoint("llama")
    async with engine_stack(bus, model_dir, num_engines=2, **options) as stack:
        stream = Stream()
        task = asyncio.ensure_future(stream.run(stack.client, PROMPTS[4], "r", 1))
        await wait_for(lambda: stream.num_tokens >= 4, 60, "the request streams")
        victim = await busiest(stack.engines)
        await victim.stop()
        await asyncio.wait_for(task, 120)
        assert stack.client.resumptions.num_resumptions_total == 1
    assert stream.finish_reasons[0] == "length" and stream.num_tokens == MAX_TOKENS

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = Counter(s.name for s in spans)
        return names["llm_request"] == 1 and names["engine_core.request"] == 2

    spans = await asyncio.to_thread(receiver.wait_for, complete, 30)
    llm_request = only(spans, "llm_request")
    assert {s.trace_id for s in spans} == {llm_request.trace_id}  # one trace
    assert llm_request.parent_span_id == "" and llm_request.service == "shoal-engine-client"
    assert llm_request.attributes["gen_ai.usage.completion_tokens"] == MAX_TOKENS
    attempts = sorted(children(spans, llm_request, "engine_core.request"), key=lambda s: s.start_ns)
    assert [a.attributes["shoal.engine.id"] for a in attempts] == [victim.engine_id, *(
        e.engine_id for e in stack.engines if e is not victim
    )]  # fmt: skip
    cut, resumed = attempts
    assert cut.failed and cut.attributes["gen_ai.response.finish_reasons"] == ["error"]
    assert resumed.attributes["shoal.request.num_resumed_tokens"] >= 4
    assert resumed.attributes["gen_ai.response.finish_reasons"] == ["length"]
    steps = check_engine_request(spans, cut) + check_engine_request(spans, resumed)
    worker_ids = {
        only(children(spans, step, "worker.execute"), "worker.execute").resource[
            "service.instance.id"
        ]
        for step in steps
    }
    assert worker_ids == {"w0", "w1"}


async def test_a_nats_api_request_continues_its_callers_trace(
    bus_factory: Any, tiny_checkpoint: Any, receiver: HttpReceiver
) -> None:
    """The caller's context in the request's NATS headers parents the gateway's span."""
    bus = await bus_factory()
    options = {"otlp_traces_endpoint": receiver.endpoint}
    async with engine_stack(bus, tiny_checkpoint("llama"), **options) as stack:
        config = ObservabilityConfig(otlp_traces_endpoint=receiver.endpoint)
        tracer = actor_tracer(config, "gateway", "gateway-0")
        api = NatsApi(bus, serving_context(stack.client), tracer=tracer)
        await api.start()
        trace_id, caller_span, header = traceparent()
        params = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
        payload = msgspec.msgpack.encode(
            {"prompt": "hi", "sampling_params": params, "stream": True}
        )
        try:
            subject = api.subjects.api_generate()
            replies = request_stream(
                bus, subject, payload, timeout=60, headers={"traceparent": header}
            )
            bodies = [msgspec.msgpack.decode(m.data) async for m in replies]
        finally:
            await api.stop()
            await close_tracer(tracer)
    assert bodies[-1]["usage"]["completion_tokens"] == 4

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = Counter(s.name for s in spans)
        return names["nats generate"] == 1 and names["worker.execute"] == 4

    spans = await asyncio.to_thread(receiver.wait_for, complete, 30)
    assert {s.trace_id for s in spans} == {trace_id}
    gateway = only(spans, "nats generate")
    assert gateway.parent_span_id == caller_span and gateway.kind == "server"
    (llm_request,) = children(spans, gateway, "llm_request")
    (request,) = children(spans, llm_request, "engine_core.request")
    assert len(check_engine_request(spans, request)) == 4


async def test_with_tracing_off_nothing_is_exported(
    tiny_checkpoint: Any, receiver: HttpReceiver, monkeypatch: Any
) -> None:
    """The collector named in OpenTelemetry's own environment gets nothing without the flag."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
    from shoal.bus.transport.memory import InMemoryBus

    async with engine_stack(InMemoryBus(), tiny_checkpoint("llama")) as stack:
        stream = Stream()
        await stream.run(stack.client, PROMPTS[0], "r", 1)
        assert stack.client.tracer is None and stack.engines[0].tracing is None
        assert stack.workers[0].tracer is None
    await asyncio.sleep(0.5)
    assert receiver.num_exports == 0


def test_without_the_flag_no_actor_imports_opentelemetry() -> None:
    code = (
        "import sys\n"
        "import shoal.gateway.actor, shoal.engine.actor.core_actor, shoal.workers.actor\n"
        "import shoal.engine.client.engine_client, shoal.deploy.cli\n"
        "from shoal.config.observability import ObservabilityConfig\n"
        "from shoal.tracing.setup import actor_tracer, check_tracing\n"
        "check_tracing(ObservabilityConfig())\n"
        "assert actor_tracer(ObservabilityConfig(), 'engine', 'e0') is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_default_protocol_is_grpc(monkeypatch: Any) -> None:
    """vLLM's default: the endpoint is a collector's gRPC address."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)

    receiver = GrpcReceiver()
    try:
        config = ObservabilityConfig(otlp_traces_endpoint=receiver.endpoint)
        tracer = actor_tracer(config, "gateway", "gateway-0")
        assert tracer is not None
        root = tracer.start("root", None)
        tracer.record("child", root, 1, 2, attributes={"k": 3})
        root.end()
        tracer.shutdown()
        spans = receiver.wait_for(lambda s: len(s) == 2, 10)
    finally:
        receiver.close()
    child, root_span = sorted(spans, key=lambda s: s.name)
    assert child.parent_span_id == root_span.span_id and child.attributes == {"k": 3}
    assert root_span.resource["service.instance.id"] == "gateway-0"
    assert root_span.service == "shoal-gateway"


# ----- processes: shoal serve on nats-server (gateway + client, engine core, worker)


async def completion(url: str, prompt: str, headers: dict[str, str]) -> tuple[int, str]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body, headers=headers) as response,
    ):
        answer = json.loads(await response.text())
    text = answer["choices"][0]["text"] if response.status == 200 else ""
    return response.status, text


@pytest.mark.slow
async def test_a_request_is_one_trace_across_the_actor_processes(
    tiny_checkpoint: Any, receiver: HttpReceiver
) -> None:
    flags = ("--otlp-traces-endpoint", receiver.endpoint)
    server = Server(tiny_checkpoint("llama"), *flags, env=HTTP_EXPORT)
    try:
        url = await asyncio.to_thread(server.wait_for, r"is serving .* on (http://\S+)", 240)
        await wait_http_ready(url, 60)
        trace_id, caller_span, header = traceparent()
        unsampled_id, _, unsampled = traceparent(sampled=False)
        traced = await completion(url, "the fox", {"traceparent": header})
        hidden = await completion(url, "the fox", {"traceparent": unsampled})
        plain = await completion(url, "the fox", {})
        assert traced == hidden == plain and traced[0] == 200
        bad_status, _ = await _bad_request(url, header)
        assert bad_status == 400
        pids = {kind: server.pid_of(actor) for kind, actor in
                (("engine", "engine-0"), ("worker", "worker-0-0"))}  # fmt: skip

        def complete(spans: list[ReceivedSpan]) -> bool:
            """Every span the checks below read has arrived (each process exports its own
            batches, so the engine core's may come after the worker's and the gateway's)."""
            names = Counter(s.name for s in spans if s.trace_id == trace_id)
            return (
                names["worker.execute"] >= 8
                and names["engine_core.step"] >= 8
                and names["engine_core.request"] == names["engine_core.queue"] == 1
                and names["engine_core.schedule"] >= 1
                and names["llm_request"] == 1
                and names["POST /v1/completions"] == 2
            )

        spans = await asyncio.to_thread(receiver.wait_for, complete, 30)
    finally:
        server.stop()
    assert not [s for s in spans if s.trace_id == unsampled_id]
    others = {s.trace_id for s in spans} - {trace_id}
    assert len(others) == 1  # the request without a caller's context: a trace of its own
    mine = [s for s in spans if s.trace_id == trace_id]
    gateways = sorted(
        (s for s in mine if s.name == "POST /v1/completions"), key=lambda s: s.start_ns
    )
    assert [g.attributes["http.response.status_code"] for g in gateways] == [200, 400]
    gateway = gateways[0]
    assert gateway.parent_span_id == caller_span and gateway.kind == "server"
    assert gateway.service == "shoal-gateway"
    (llm_request,) = children(mine, gateway, "llm_request")
    assert llm_request.service == "shoal-engine-client" and within(llm_request, gateway)
    (request,) = children(mine, llm_request, "engine_core.request")
    steps = check_engine_request(mine, request)
    assert len(steps) == 8  # the prefill's step samples the first token, one step per other
    assert [s.attributes["shoal.step.num_tokens"] for s in steps][1:] == [1] * 7
    processes = {s.service: s.resource["process.pid"] for s in mine}
    assert processes["shoal-gateway"] == processes["shoal-engine-client"] == server.proc.pid
    assert processes["shoal-engine"] == pids["engine"]
    assert processes["shoal-worker"] == pids["worker"]


async def _bad_request(url: str, header: str) -> tuple[int, str]:
    body = {"prompt": "the fox", "max_tokens": -1}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body, headers={"traceparent": header}) as r,
    ):
        return r.status, await r.text()


def test_an_unknown_protocol_is_a_clear_error_at_start(tiny_checkpoint: Any) -> None:
    command = [sys.executable, "-m", "shoal.deploy.cli", "serve", str(tiny_checkpoint("llama")),
               "--otlp-traces-endpoint", "http://127.0.0.1:1"]  # fmt: skip
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert out.returncode == 2
    assert (
        "OTLP protocol 'http/json' is not supported: use one of grpc, http/protobuf" in out.stderr
    )
