"""Fault tolerance with every actor in its own process over a real nats-server, the recovery
controller off (an operator's retries): a worker SIGKILLed makes its engine core DEAD (retry
refused), UNHEALTHY once the supervisor restarted the worker, and a retry brings it back
serving the same greedy tokens; an engine core left without a retry past its recovery timeout
exits for its supervisor to restart it."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from shoal.bus.messages.control import ActorState
from shoal.bus.messages.sampling import OutputKind, SamplingParams
from shoal.bus.runtime.supervisor import ChildState
from shoal.bus.subjects import Subjects
from shoal.deploy.deployment import build_config
from shoal.engine.actor.sentinel import EXIT_RECOVERY_TIMEOUT
from tests.integration.conditions import wait_for
from tests.integration.fault_tools import inject_engine_fault, send_instruction
from tests.integration.process_deployment import process_deployment

pytestmark = [pytest.mark.timeout(300), pytest.mark.nats, pytest.mark.slow]

PROMPT = [5, 17, 42, 7, 99, 3, 12, 8]


def _config(model_dir, namespace: str, **options):  # type: ignore[no-untyped-def]
    return build_config(
        model=str(model_dir),
        num_gpu_blocks_override=96,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        namespace=namespace,
        worker_dead_after_s=2.0,
        **{"enable_fault_tolerance": True, "enable_recovery_controller": False, **options},
    )


async def _greedy(client, request_id: str) -> list[int]:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    final = None
    async for output in client.generate(PROMPT, params, request_id):
        final = output
    assert final is not None and final.outputs[0].finish_reason == "length", final
    return list(final.outputs[0].token_ids)


def _engine_state(client) -> ActorState | None:  # type: ignore[no-untyped-def]
    peer = client.router.liveness.get("engine-0")
    return None if peer is None else peer.state


async def test_worker_sigkill_dead_then_restart_then_retry(nats_server, tiny_checkpoint):  # type: ignore[no-untyped-def]
    config = _config(tiny_checkpoint("llama"), "ftkill")
    subjects = Subjects("ftkill")
    async with process_deployment(nats_server.url, config) as deployed:
        client, supervisor = deployed.client, deployed.supervisor
        before = await _greedy(client, "before")
        pid = supervisor.pid("worker-0-0")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await wait_for(lambda: _engine_state(client) is ActorState.DEAD, 20, "engine core DEAD")
        peer = client.router.liveness.get("engine-0")
        assert peer is not None and "worker-0-0" in peer.reason
        rejected = await send_instruction(client.bus, subjects, "engine-0")
        if not rejected.success:  # the restarted worker may already be up: then it is UNHEALTHY
            assert "is dead" in (rejected.reason or "") or "unhealthy" not in (
                rejected.reason or ""
            )
        await supervisor.wait_for("worker-0-0", ChildState.RUNNING, timeout=60, min_restarts=1)
        await wait_for(
            lambda: _engine_state(client) in (ActorState.UNHEALTHY, ActorState.READY),
            60,
            "engine core UNHEALTHY once its worker is back",
        )
        if _engine_state(client) is ActorState.UNHEALTHY:
            assert (await send_instruction(client.bus, subjects, "engine-0")).success
        await wait_for(lambda: client.is_ready(), 20, "engine core ready")
        assert await _greedy(client, "after") == before
        assert supervisor.num_restarts("engine-0") == 0  # recovered, not restarted


async def test_recovery_timeout_exits_and_the_supervisor_restarts(nats_server, tiny_checkpoint):  # type: ignore[no-untyped-def]
    config = _config(
        tiny_checkpoint("llama"),
        "fttimeout",
        engine_recovery_timeout_sec=2,
        enable_request_resumption=False,  # the victim's clean error is the point here
    )
    subjects = Subjects("fttimeout")
    async with process_deployment(nats_server.url, config) as deployed:
        client, supervisor = deployed.client, deployed.supervisor
        epoch = client.router.epoch("engine-0")
        await inject_engine_fault(client.bus, subjects, "engine-0")
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        async for output in client.generate(PROMPT, params, "victim"):
            final = output
        assert final.outputs[0].finish_reason == "error"
        await supervisor.wait_for("engine-0", ChildState.RUNNING, timeout=60, min_restarts=1)
        exits = [
            e for e in supervisor.events if e.name == "engine-0" and e.state is ChildState.EXITED
        ]
        assert [e.returncode for e in exits] == [EXIT_RECOVERY_TIMEOUT]
        await wait_for(lambda: client.router.epoch("engine-0") > epoch, 60, "a new incarnation")
        await wait_for(lambda: client.is_ready(), 60, "engine core ready")
        assert len(await _greedy(client, "after")) == 16


async def test_streams_cut_by_a_worker_sigkill_resume_without_gap_or_repeat(
    nats_server, tiny_checkpoint
):  # type: ignore[no-untyped-def]
    """DP=1 with the recovery controller: the worker dies mid-stream, the requests wait for the
    engine core's recovery and finish there; each stream's deltas join to the no-fault text."""
    config = _config(
        tiny_checkpoint("llama"),
        "ftstream",
        enable_recovery_controller=True,
        recovery_backoff_s=0.2,
    )
    async with process_deployment(nats_server.url, config) as deployed:
        client, supervisor = deployed.client, deployed.supervisor
        prompts = [PROMPT, PROMPT[::-1], [9, 8, 7, 6, 5]]
        calm = [await _stream(client, p, f"calm-{i}") for i, p in enumerate(prompts)]
        started = Started(len(prompts))
        streams = [
            asyncio.create_task(_stream(client, p, f"cut-{i}", started))
            for i, p in enumerate(prompts)
        ]
        await asyncio.wait_for(started.all.wait(), 30)  # every stream has had text
        pid = supervisor.pid("worker-0-0")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert not any(stream.done() for stream in streams)  # cut mid-stream
        cut = await asyncio.wait_for(asyncio.gather(*streams), 120)
        assert supervisor.num_restarts("worker-0-0") == 1
        assert cut == calm  # (text joined from the deltas, token ids): no gap, no repeat


class Started:
    """Set ``all`` once ``num_streams`` streams have had 20 tokens each."""

    def __init__(self, num_streams: int) -> None:
        self.num_streams = num_streams
        self.request_ids: set[str] = set()
        self.all = asyncio.Event()

    def mark(self, request_id: str) -> None:
        self.request_ids.add(request_id)
        if len(self.request_ids) == self.num_streams:
            self.all.set()


async def _stream(client, prompt: list[int], request_id: str, started: Started | None = None):  # type: ignore[no-untyped-def]
    """A streamed greedy request of 900 tokens: its deltas joined, and its token ids."""
    params = SamplingParams(
        temperature=0.0, max_tokens=900, ignore_eos=True, output_kind=OutputKind.DELTA
    )
    text, tokens = [], []
    async for output in client.generate(prompt, params, request_id):
        text.append(output.outputs[0].text)
        tokens.extend(output.outputs[0].token_ids)
        if started is not None and len(tokens) >= 20:
            started.mark(request_id)
        if output.finished:
            assert output.outputs[0].finish_reason == "length", output
    return "".join(text), tokens
