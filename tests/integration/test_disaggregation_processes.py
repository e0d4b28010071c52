"""Disaggregated prefill with every actor in its own process over a real nats-server: a prefill
engine core of two tensor-parallel workers hands prompts over to a decode engine core of one,
as two deployments that share a namespace would (``shoal actor engine --kv-role ...``). The
decode worker reads each KV head from the prefill rank holding it, out of that process's
exported cache: greedy outputs equal a colocated engine core's, and the decode engine core's
published counters show every long prompt pulled, none recomputed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shoal.bus import connect_bus
from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.runtime.supervisor import ActorSpec, Supervisor
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.config.deployment import ShoalConfig
from shoal.deploy.deployment import ActorPlan, plan_actors
from shoal.deploy.local import free_tcp_port
from shoal.engine.client.engine_client import AsyncEngineClient
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import engine_stack
from tests.integration.process_deployment import FAST_HEARTBEATS
from tests.integration.test_disaggregation import BLOCK_SIZE, GREEDY, LONG, SHORT, generate

pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio]

NAMESPACE = "disagg-procs"


def role_config(model_dir: Path, role: str, **more: Any) -> ShoalConfig:
    return ShoalConfig.from_options(
        model=str(model_dir),
        namespace=NAMESPACE,
        dtype="float32",
        num_gpu_blocks_override=128,
        block_size=BLOCK_SIZE,
        disagg_role=role,
        max_local_prefill_length=24,
        max_prefill_queue_size=64,
        **more,
    )


def renamed(plans: list[ActorPlan], prefix: str) -> list[ActorPlan]:
    """One role's actors under ids of their own (``engine-0`` → ``{prefix}-engine-0``)."""
    names = {p.name: f"{prefix}-{p.name}" for p in plans}
    out = []
    for plan in plans:
        kwargs = dict(plan.kwargs)
        for key in ("worker_id", "engine_id"):
            if key in kwargs:
                kwargs[key] = names[kwargs[key]]
        if "worker_ids" in kwargs:
            kwargs["worker_ids"] = [names[w] for w in kwargs["worker_ids"]]
        out.append(ActorPlan(names[plan.name], plan.target, kwargs, plan.kind))
    return out


@dataclass
class TwoRoles:
    client: AsyncEngineClient
    supervisor: Supervisor


@contextlib.asynccontextmanager
async def two_roles(
    nats_url: str, model_dir: Path, prefill_tp: int = 1, **more: Any
) -> AsyncIterator[TwoRoles]:
    """A prefill deployment (``p-``) and a decode one (``d-``) in one namespace, each actor a
    supervised process; the decode one's recovery controller (if any) serves both."""
    # A slow prefill side (two prompts at a time): handovers are still queued there when the
    # first ones have been pulled.
    prefill = role_config(
        model_dir, "prefill", tensor_parallel_size=prefill_tp, max_num_seqs=2, **more
    )
    decode = role_config(model_dir, "decode", **more)
    tp_inits = [f"tcp://127.0.0.1:{free_tcp_port()}"] if prefill_tp > 1 else None
    plans = [
        *renamed(
            [p for p in plan_actors(prefill, tp_init_methods=tp_inits) if p.kind != "recovery"],
            "p",
        ),
        *renamed(plan_actors(decode), "d"),
    ]
    specs = [
        ActorSpec(p.name, p.target, nats_url, {**p.kwargs, **FAST_HEARTBEATS}, kind=p.kind)
        for p in plans
    ]
    bus = await connect_bus(nats_url)
    supervisor = Supervisor(specs, status_bus=bus, namespace=NAMESPACE)
    await supervisor.start()
    client = AsyncEngineClient(bus, decode)
    await client.start()
    try:
        await client.wait_until_ready(120, num_engines=2)
        yield TwoRoles(client, supervisor)
    finally:
        await client.close()
        await supervisor.stop()
        await bus.close()


async def reference(
    model_dir: Path, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    bus = InMemoryBus(InMemoryBroker())
    await bus.connect()
    try:
        async with engine_stack(bus, model_dir, block_size=BLOCK_SIZE) as stack:
            return await generate(stack.client, prompts, "ref", params=params)
    finally:
        await bus.close()


def published(client: AsyncEngineClient, engine_id: str) -> SchedulerStats:
    return client.router.engines[engine_id].stats.stats


def resolved_pulls(stats: SchedulerStats) -> int:
    """Continuations whose pull landed, failed (recomputed) or came too late (recomputed)."""
    return stats.kv_pulls + stats.kv_pull_failures + stats.kv_pull_late


async def test_a_tp2_prefill_hands_over_to_a_tp1_decode_across_processes(
    nats_url, tiny_checkpoint
) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    expected = await reference(model_dir, LONG + SHORT)
    async with two_roles(nats_url, model_dir, prefill_tp=2) as roles:
        client = roles.client
        assert {v.engine_id: v.role for v in client.router.ready_engines()} == {
            "p-engine-0": "prefill",
            "d-engine-0": "decode",
        }
        assert await generate(client, LONG + SHORT, "pd") == expected
        await wait_for(
            lambda: (
                published(client, "d-engine-0").kv_pulls == len(LONG)
                and published(client, "p-engine-0").kv_handover_released == len(LONG)
            ),
            30,
            "the pulls and releases published",
        )
        decode = published(client, "d-engine-0")
        assert decode.kv_pull_failures == 0 and decode.kv_pulled_tokens == sum(map(len, LONG))
        assert decode.kv_pull_bytes > 0


MANY = [[(3 * i + 11 * j) % 230 + 9 for i in range(40 + 7 * (j % 5))] for j in range(32)]
RESILIENT = {"enable_fault_tolerance": True, "enable_request_resumption": True}
# Streams long enough that the decode side is still in the middle of some once the counters of
# its first pulls have been published (every 50 ms at most).
CHAOS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("victim", ["p-worker-0-0", "p-engine-0", "d-engine-0"])
async def test_either_side_killed_under_load_still_gives_the_calm_outputs(
    nats_url, tiny_checkpoint, victim
) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL of the prefill worker or engine core while handovers are under way, or of the
    decode engine core mid-stream: every request completes with the calm run's greedy output
    (prefilled again, pulled again or recomputed: the counters say which)."""
    model_dir = tiny_checkpoint("llama")
    expected = await reference(model_dir, MANY, CHAOS)
    async with two_roles(nats_url, model_dir, **RESILIENT) as roles:
        client = roles.client
        # Set each time a request has streamed more than its first token (the prefill side's)
        # and at most half of its own: a stream the decode side is in the middle of. Watched at
        # each output, not polled: a stream may pass through that window between two polls.
        mid_stream = asyncio.Event()

        def watch(index: int, num_tokens: int) -> None:
            if 1 < num_tokens <= len(expected[index]) // 2:
                mid_stream.set()

        running = asyncio.ensure_future(generate(client, MANY, "chaos", watch, CHAOS))
        # (the pulls are counted here, before any kill: a decode-side kill takes the engine
        # core's counters with it)
        await wait_for(
            lambda: published(client, "d-engine-0").kv_pulls >= 3, 60, "handovers under way"
        )
        if victim.startswith("d-"):  # a stream from the decode side at most half done, now
            mid_stream.clear()
            await asyncio.wait_for(mid_stream.wait(), 60)
        pid = roles.supervisor.pid(victim)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert await asyncio.wait_for(running, 240) == expected
        if victim.startswith("d-"):  # its streams were cut: resumed elsewhere
            assert client.resumptions.num_resumptions_total > 0
        # (a prefill-side kill may land once every prefill there is done: then it cuts no
        # request, and the accounting below is what it can change)
        if victim.startswith("p-"):
            # Every handover the decode engine core took was pulled where its KV still existed
            # or, the prefill side gone, recomputed: none lost, none read from a dead cache.
            handed_over = client.disagg.num_handed_over
            await wait_for(
                lambda: resolved_pulls(published(client, "d-engine-0")) == handed_over,
                30,
                "every handover pulled or recomputed",
            )
