"""Requests survive a fault, through the real engine (workers, engine cores, engine client) on
the in-memory bus and on nats-server: greedy requests in flight on an engine core that stops
finish on the other one with the output of a run without the fault, and their streamed deltas
join to the full text with nothing missing or repeated; with resumption off they end with a
clean error; a request turned away as 'unavailable' goes to another engine core; a request is
resumed at most ``max_request_resumptions`` times and waits at most
``request_resume_timeout_s`` for a ready engine core."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import msgspec
import pytest

from shoal.bus.base import Bus
from shoal.bus.codec import Codec, encode
from shoal.bus.messages.control import ActorState, Heartbeat
from shoal.bus.messages.engine import (
    AddRequest,
    EngineInbound,
    EngineStats,
    RequestRejected,
    SchedulerStats,
)
from shoal.bus.messages.sampling import OutputKind, SamplingParams
from shoal.bus.msg import Msg
from shoal.config.deployment import ShoalConfig
from shoal.engine.actor.core_actor import EngineCoreActor
from shoal.engine.client.engine_client import AsyncEngineClient
from tests.fixtures.models import make_prompts
from tests.integration.conditions import core_is_settled, wait_for
from tests.integration.engine_stack import engine_stack
from tests.integration.fault_tools import inject_engine_fault, send_instruction

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 48
FT = {"request_resume_timeout_s": 30.0}
PROMPTS = make_prompts((3, 7, 15, 17, 33, 9))


def greedy(kind: OutputKind = OutputKind.FINAL_ONLY, n: int = 1) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=kind, n=n
    )


class Stream:
    """One streamed (DELTA) request: every delta per completion, and how it ended."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}
        self.finish_reasons: dict[int, str | None] = {}

    async def run(self, client: AsyncEngineClient, prompt: list[int], rid: str, n: int) -> None:
        async for out in client.generate(prompt, greedy(OutputKind.DELTA, n), rid):
            for completion in out.outputs:
                i = completion.index
                self.tokens.setdefault(i, []).extend(completion.token_ids)
                self.text[i] = self.text.get(i, "") + completion.text
                self.finish_reasons[i] = completion.finish_reason

    @property
    def num_tokens(self) -> int:
        return min((len(t) for t in self.tokens.values()), default=0)


async def reference_run(client: AsyncEngineClient) -> list[tuple[list[int], str]]:
    """The no-fault outputs (token ids, text) of every prompt."""

    async def final(prompt: list[int], rid: str) -> tuple[list[int], str]:
        last = None
        async for out in client.generate(prompt, greedy(), rid):
            last = out
        assert last is not None and last.outputs[0].finish_reason == "length"
        return last.outputs[0].token_ids, last.outputs[0].text

    return await asyncio.gather(*(final(p, f"ref{i}") for i, p in enumerate(PROMPTS)))


def running_with_output(engine: EngineCoreActor, min_tokens: int = 2) -> int:
    """Requests on this engine core that have produced ``min_tokens`` already."""
    core = engine.core
    if core is None:
        return 0
    return sum(r.num_output_tokens >= min_tokens for r in core.scheduler.requests.values())


async def busiest(engines: list[EngineCoreActor]) -> EngineCoreActor:
    """The engine core with the most requests running that have output already (one at least)."""
    await wait_for(
        lambda: any(running_with_output(e) for e in engines), 60, "requests running with output"
    )
    return max(engines, key=running_with_output)


async def start_streams(client: AsyncEngineClient, n: int = 1) -> tuple[list[Stream], Any]:
    streams = [Stream() for _ in PROMPTS]
    tasks = asyncio.gather(
        *(
            s.run(client, p, f"s{i}", n)
            for i, (s, p) in enumerate(zip(streams, PROMPTS, strict=True))
        )
    )
    return streams, tasks


@pytest.mark.parametrize("n", [1, 2])
async def test_requests_on_a_stopped_engine_core_finish_on_the_other(
    bus_factory: Any, tiny_checkpoint: Any, n: int
) -> None:
    bus = await bus_factory()
    model_dir = tiny_checkpoint("llama")
    async with engine_stack(bus, model_dir, num_engines=2, fault_tolerance_config=FT) as stack:
        reference = await reference_run(stack.client)
        streams, tasks = await start_streams(stack.client, n)
        victim = await busiest(stack.engines)
        assert victim.core is not None
        cut = {rid.split("_")[-1] for rid in victim.core.scheduler.requests}
        await victim.stop()
        await asyncio.wait_for(tasks, 120)
        assert 1 <= stack.client.resumptions.num_resumptions_total <= len(cut)
    for stream, (tokens, text) in zip(streams, reference, strict=True):
        assert sorted(stream.tokens) == list(range(n))
        for i in range(n):
            assert stream.tokens[i] == tokens  # no gap, no repeat, the no-fault tokens
            assert stream.text[i] == text
            assert stream.finish_reasons[i] == "length"


@pytest.mark.parametrize(
    "ft", [{"enable_request_resumption": False}, {"enable_fault_tolerance": False}]
)
async def test_without_resumption_requests_on_a_stopped_engine_core_end_with_an_error(
    bus_factory: Any, tiny_checkpoint: Any, ft: dict[str, Any]
) -> None:
    bus = await bus_factory()
    model_dir = tiny_checkpoint("llama")
    options: dict[str, Any] = {"fault_tolerance_config": ft}
    async with engine_stack(bus, model_dir, num_engines=2, **options) as stack:
        reference = await reference_run(stack.client)
        streams, tasks = await start_streams(stack.client)
        victim = await busiest(stack.engines)
        await victim.stop()
        await asyncio.wait_for(tasks, 120)
    reasons = [s.finish_reasons[0] for s in streams]
    assert "error" in reasons and set(reasons) <= {"error", "length"}, reasons
    for stream, (tokens, _) in zip(streams, reference, strict=True):
        if stream.finish_reasons[0] == "length":
            assert stream.tokens[0] == tokens
        else:
            assert len(stream.tokens[0]) < MAX_TOKENS


def engine_running(engines: list[EngineCoreActor], request_id: str) -> EngineCoreActor | None:
    """The engine core running this engine-side request with output already, if any."""
    for engine in engines:
        request = engine.core.scheduler.requests.get(request_id) if engine.core else None
        if request is not None and request.num_output_tokens - request.num_resumed_tokens >= 1:
            return engine
    return None


async def test_a_request_resumed_more_than_allowed_ends_with_an_error(
    bus_factory: Any, tiny_checkpoint: Any
) -> None:
    """Resumed once (the limit), then cut again: an error, though a third engine core is ready."""
    bus = await bus_factory()
    model_dir = tiny_checkpoint("llama")
    ft = {**FT, "max_request_resumptions": 1}
    async with engine_stack(bus, model_dir, num_engines=3, fault_tolerance_config=ft) as stack:
        stream = Stream()
        task = asyncio.ensure_future(stream.run(stack.client, PROMPTS[0], "r", 1))
        for attempt_id in ("r", "r@1"):  # the engine-side id of each attempt
            running = functools.partial(engine_running, stack.engines, attempt_id)
            await wait_for(running, 60, f"{attempt_id} runs")
            engine = engine_running(stack.engines, attempt_id)
            assert engine is not None
            await engine.stop()
        await asyncio.wait_for(task, 60)
        assert not stack.client.resumptions.parked
    assert stream.finish_reasons[0] == "error"
    assert 2 <= len(stream.tokens[0]) < MAX_TOKENS


async def test_a_parked_request_waits_at_most_the_resume_timeout(
    bus_factory: Any, tiny_checkpoint: Any
) -> None:
    bus = await bus_factory()
    model_dir = tiny_checkpoint("llama")
    ft = {"request_resume_timeout_s": 1.0}
    async with engine_stack(bus, model_dir, num_engines=1, fault_tolerance_config=ft) as stack:
        stream = Stream()
        task = asyncio.ensure_future(stream.run(stack.client, PROMPTS[0], "r", 1))
        await wait_for(lambda: stream.num_tokens >= 2, 60, "the request streams")
        await stack.engines[0].stop()
        await wait_for(lambda: stack.client.resumptions.parked, 30, "the request is parked")
        await asyncio.wait_for(task, 30)
    assert stream.finish_reasons[0] == "error"


_INBOUND: Codec[EngineInbound] = Codec(EngineInbound)


async def serve_as_unavailable(bus: Bus, client: AsyncEngineClient, seen: list[str]) -> Any:
    """A stand-in engine core 'x' that looks ready and the least loaded, and turns every add
    away as unavailable (as one that just faulted does)."""
    subjects = client.subjects

    async def on_add(msg: Msg) -> None:
        add = _INBOUND.decode(msg.data)
        if not isinstance(add, AddRequest):
            return
        seen.append(add.request_id)
        rejected = RequestRejected(add.request_id, "unavailable", "engine x is UNHEALTHY")
        await bus.publish(subjects.engine_out(client.client_id), encode(rejected))

    sub = await bus.subscribe(subjects.engine_in("x"), on_add)
    now = time.time()
    await bus.publish(
        subjects.heartbeat("engine"),
        encode(Heartbeat("x", "engine", 1, ActorState.READY, now, incarnation="x1")),
    )
    stats = EngineStats("x", SchedulerStats(num_waiting=-100), now, incarnation="x1")
    await bus.publish(subjects.engine_stats("x"), encode(stats))
    await bus.flush()
    await wait_for(lambda: client.router.is_ready("x"), 10, "x looks ready")
    return sub


@pytest.mark.parametrize("resume", [True, False])
async def test_a_request_turned_away_as_unavailable_goes_to_another_engine_core(
    bus_factory: Any, tiny_checkpoint: Any, resume: bool
) -> None:
    bus = await bus_factory()
    model_dir = tiny_checkpoint("llama")
    ft = {**FT, "enable_request_resumption": resume}
    async with engine_stack(bus, model_dir, num_engines=1, fault_tolerance_config=ft) as stack:
        reference = await reference_run(stack.client)  # before x shows up
        seen: list[str] = []
        sub = await serve_as_unavailable(bus, stack.client, seen)
        stream = Stream()
        try:
            await asyncio.wait_for(stream.run(stack.client, PROMPTS[0], "r", 1), 60)
        except Exception as exc:  # the no-resumption case ends with an error
            assert not resume, exc
            assert "unavailable" in str(exc)
        else:
            assert resume
            assert stream.tokens[0] == reference[0][0] and stream.text[0] == reference[0][1]
        await sub.unsubscribe()
    assert seen == ["r"]


async def test_a_request_turned_away_waits_for_a_ready_it_hears_as_no_change(
    bus_factory: Any, tiny_checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client missed the engine core's fault (its UNHEALTHY status went with a dropped bus
    connection): the core turns the request away as unavailable, then publishes READY, which
    the client hears as no change. The rejection itself says the core was not ready, so the
    request goes back to it once READY (it used to wait out the resume timeout)."""
    bus = await bus_factory()
    model_dir = tiny_checkpoint("llama")
    ft = {"request_resume_timeout_s": 8.0}
    async with engine_stack(bus, model_dir, num_engines=1, fault_tolerance_config=ft) as stack:
        engine, client = stack.engines[0], stack.client
        reference = await reference_run(client)
        assert engine.core is not None
        turned_away: list[str] = []
        turn_away = engine.core.turn_away
        monkeypatch.setattr(
            engine.core, "turn_away", lambda m: (turned_away.append(m.request_id), turn_away(m))
        )
        beat = engine.make_heartbeat  # what the client hears says READY throughout
        monkeypatch.setattr(
            engine,
            "make_heartbeat",
            lambda: msgspec.structs.replace(beat(), state=ActorState.READY),
        )
        engine.state = ActorState.UNHEALTHY  # unpublished
        stream = Stream()
        task = asyncio.ensure_future(stream.run(client, PROMPTS[0], "r", 1))
        await wait_for(lambda: turned_away, 30, "the request turned away")
        await engine.set_state(ActorState.READY)
        await asyncio.wait_for(task, 60)
        assert client.resumptions.num_resumptions_total == 0  # a rejection is no fault
    assert stream.finish_reasons[0] == "length"
    assert stream.tokens[0] == reference[0][0] and stream.text[0] == reference[0][1]


async def test_requests_cut_by_an_injected_fault_resume_on_the_same_engine_core_after_retry(
    bus_factory: Any, tiny_checkpoint: Any
) -> None:
    """DP=1: the sentinel ends the requests resumable, the engine core is UNHEALTHY (they wait,
    parked), a retry makes it READY and they continue there with the no-fault output."""
    bus = await bus_factory()
    model_dir = tiny_checkpoint("llama")
    async with engine_stack(bus, model_dir, num_engines=1, fault_tolerance_config=FT) as stack:
        engine, subjects = stack.engines[0], stack.engines[0].subjects
        reference = await reference_run(stack.client)
        await inject_engine_fault(bus, subjects, "e0", after_steps=6)
        streams, tasks = await start_streams(stack.client, n=2)
        await wait_for(lambda: engine.state is ActorState.UNHEALTHY, 60, "the fault")
        await wait_for(lambda: stack.client.resumptions.parked, 30, "requests parked")
        assert engine.core is not None and not engine.core.scheduler.requests
        assert all(s.num_tokens < MAX_TOKENS for s in streams)
        result = await send_instruction(bus, subjects, "e0")
        assert result.success, result
        await asyncio.wait_for(tasks, 120)
        assert stack.client.resumptions.num_resumptions_total == len(PROMPTS)
    for stream, (tokens, text) in zip(streams, reference, strict=True):
        for i in range(2):
            assert stream.tokens[i] == tokens and stream.text[i] == text
            assert stream.finish_reasons[i] == "length"


async def test_the_clients_own_reconnect_resumes_its_requests(
    bus_factory: Any, tiny_checkpoint: Any
) -> None:
    """Outputs in flight may have gone with the connection: every request is sent again (the
    old attempts are aborted) and still streams the no-fault output once."""
    bus = await bus_factory()
    model_dir = tiny_checkpoint("llama")
    async with engine_stack(bus, model_dir, num_engines=2, fault_tolerance_config=FT) as stack:
        reference = await reference_run(stack.client)
        config = ShoalConfig.from_options(model=str(model_dir), fault_tolerance_config=FT)
        client = await AsyncEngineClient(await bus_factory(), config).start()
        await client.wait_until_ready(30, num_engines=2)
        streams, tasks = await start_streams(client)
        await busiest(stack.engines)
        in_flight = len(client.placements.placed())
        client.bus._reconnected()  # what NatsBus does when its connection is back
        await asyncio.wait_for(tasks, 120)
        assert client.resumptions.num_resumptions_total == in_flight >= 1
        cores = [engine.core for engine in stack.engines if engine.core is not None]
        for core in cores:
            await wait_for(functools.partial(core_is_settled, core), 30, "settled")
        assert sum(core.stats().num_finished_abort for core in cores) >= 1  # old attempts
        await client.close()
    for stream, (tokens, text) in zip(streams, reference, strict=True):
        assert stream.tokens[0] == tokens and stream.text[0] == text


async def test_requests_cut_by_an_injected_fault_finish_on_the_other_engine_core(
    bus_factory: Any, tiny_checkpoint: Any
) -> None:
    """DP=2, no retry: the faulted engine core's requests move to the healthy one."""
    bus = await bus_factory()
    model_dir = tiny_checkpoint("llama")
    async with engine_stack(bus, model_dir, num_engines=2, fault_tolerance_config=FT) as stack:
        reference = await reference_run(stack.client)
        streams, tasks = await start_streams(stack.client)
        victim = await busiest(stack.engines)
        await inject_engine_fault(bus, victim.subjects, victim.engine_id)
        await asyncio.wait_for(tasks, 120)
        assert victim.state is ActorState.UNHEALTHY
        assert stack.client.resumptions.num_resumptions_total >= 1
    for stream, (tokens, text) in zip(streams, reference, strict=True):
        assert stream.tokens[0] == tokens and stream.text[0] == text
        assert stream.finish_reasons[0] == "length"
