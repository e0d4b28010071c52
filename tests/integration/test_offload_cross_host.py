"""KV offload across hosts through the peer-to-peer tier, with the real actors on the in-memory
bus and on a real NATS server: two "hosts" of one deployment (each its own CPU tier, p2p tier,
worker and engine core). Conversations are prefilled on host A; its engine core then goes away
and they continue on host B, whose own tiers start empty: B's misses are found in A's CPU tier
and pulled over the bus. Greedy outputs equal recompute; the counters show the loads."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from shoal.bus.base import Bus, Msg
from shoal.bus.memory import InMemoryBroker, InMemoryBus
from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.nats_bus import NatsBus
from shoal.bus.subjects import Subjects
from shoal.bus.supervisor import ActorSpec, ChildState, Supervisor
from shoal.deploy.deployment import P2P_TIER_TARGET, plan_tiers
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import EngineStack, engine_stack
from tests.integration.offload_workload import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    Turns,
    conversations,
    first_turns,
    offload_options,
    second_turns,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio]

_namespaces = itertools.count()


@contextlib.asynccontextmanager
async def host(
    bus: Bus, model_dir: Path, name: str, namespace: str, **offload: Any
) -> AsyncIterator[EngineStack]:
    """One host of deployment ``namespace``: CPU tier ``kv-<name>`` and its secondaries,
    worker ``<name>-w0``, engine core ``<name>-e0`` and a client."""
    options = offload_options(cpu_tier_id=f"kv-{name}", **offload) if offload else {}
    async with engine_stack(
        bus,
        model_dir,
        namespace=namespace,
        id_prefix=f"{name}-",
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=256,
        **options,
    ) as built:
        if offload:
            await wait_for(lambda: _connector(built).is_active, 30, "the CPU tier attached")
        yield built


def _connector(built: EngineStack) -> Any:
    core = built.engines[0].core
    assert core is not None and core.scheduler.connector is not None
    return core.scheduler.connector


async def settled_stats(built: EngineStack) -> SchedulerStats:
    engine = built.engines[0]
    core = engine.core
    assert core is not None
    await wait_for(lambda: not core.has_work(), 60, "the engine core settles")
    return engine._stats(core)


async def heard_each_other(host_a: EngineStack, host_b: EngineStack) -> None:
    """B's p2p tier knows A's (its hello was answered; A's may be another process)."""
    peer_a = _tier(host_a, "P2PTierActor").actor_id
    p2p_b = _tier(host_b, "P2PTierActor")
    await wait_for(lambda: peer_a in p2p_b.peers.expected(), 60, "B heard A's p2p tier")


def _tier(built: EngineStack, kind: str) -> Any:
    return next(t for t in built.tiers if type(t).__name__ == kind)


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return tiny_checkpoint("llama")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(model_dir: Path) -> Turns:
    """Offload off: every returning conversation recomputes its prefix."""
    bus = InMemoryBus(InMemoryBroker())
    await bus.connect()
    try:
        async with host(bus, model_dir, "ref", "xhost-ref") as built:
            return await conversations(built.client)
    finally:
        await bus.close()


def p2p_tier(direct: bool) -> dict[str, Any]:
    """A p2p tier; its direct stream (if ``direct``) on loopback."""
    tier = {"type": "p2p", "direct_transfer": direct, "data_host": "127.0.0.1"}
    return {"secondary_tiers": [tier]}


@pytest.mark.parametrize("direct", [True, False], ids=["stream", "bus-reads"])
async def test_a_conversation_prefilled_on_one_host_continues_on_another_through_p2p(
    bus_factory, model_dir, reference, direct
) -> None:  # type: ignore[no-untyped-def]
    namespace = f"xhost{next(_namespaces)}"
    p2p = p2p_tier(direct)
    bus_a, bus_b = await bus_factory(), await bus_factory()
    async with host(bus_a, model_dir, "a", namespace, **p2p) as host_a:
        answers = await first_turns(host_a.client)
        await settled_stats(host_a)
        for actor in [*host_a.engines, *host_a.workers]:  # engine core A goes; its tiers stay
            await actor.stop()
        async with host(bus_b, model_dir, "b", namespace, **p2p) as host_b:
            await heard_each_other(host_a, host_b)
            second = await second_turns(host_b.client, answers)
            stats = await settled_stats(host_b)
            pulled = _tier(host_b, "P2PTierActor").load()
            served = _tier(host_a, "P2PTierActor").load()
            promoted = _tier(host_b, "CpuTierActor").load()["num_promoted"]
    assert answers + second == reference
    assert pulled["num_chunks_loaded"] >= 4 * 8 and served["num_chunks_served"] >= 4 * 8
    assert pulled["num_chunks_streamed"] == (pulled["num_chunks_loaded"] if direct else 0)
    assert promoted == pulled["num_chunks_loaded"]
    assert stats.kv_offload_hits >= 4 * 8 * BLOCK_SIZE


async def test_a_peer_sigkilled_mid_transfer_costs_recomputes_not_wrong_tokens(
    nats_url, model_dir, reference
) -> None:  # type: ignore[no-untyped-def]
    """Host A's p2p tier runs in its own process and is SIGKILLed as soon as host B's first
    chunk read reaches it (chunks read over the bus, so the test sees the reads): B's
    promotion keeps what arrived whole, the rest is recomputed, and every returning
    conversation decodes the offload-off tokens (the supervisor restarts A's p2p tier
    meanwhile; A's CPU tier kept its chunks)."""
    namespace = f"xhost{next(_namespaces)}"
    p2p = p2p_tier(direct=False)
    bus_a, bus_b = NatsBus([nats_url]), NatsBus([nats_url])
    await bus_a.connect()
    await bus_b.connect()
    supervisor = None
    try:
        async with host(bus_a, model_dir, "a", namespace, **p2p) as host_a:
            answers = await first_turns(host_a.client)
            await settled_stats(host_a)
            for actor in [*host_a.engines, *host_a.workers]:
                await actor.stop()
            supervisor = await _p2p_tier_in_a_process(nats_url, bus_a, host_a)
            killed = await _kill_at_first_read(bus_a, host_a, supervisor)
            async with host(bus_b, model_dir, "b", namespace, **p2p) as host_b:
                await heard_each_other(host_a, host_b)
                second = await second_turns(host_b.client, answers)
                pulled = _tier(host_b, "P2PTierActor").load()
            assert killed.is_set(), "a chunk read reached host A's p2p tier"
    finally:
        if supervisor is not None:
            await supervisor.stop()
        await bus_b.close()
        await bus_a.close()
    assert answers + second == reference
    assert pulled["num_load_failures"] >= 1  # the transfer was cut


async def _p2p_tier_in_a_process(nats_url: str, bus: Bus, built: EngineStack) -> Supervisor:
    """Replace host A's in-process p2p tier with the same plan in a supervised process."""
    in_process = _tier(built, "P2PTierActor")
    await in_process.stop()
    config = built.engines[0].config
    (plan,) = [p for p in plan_tiers(config) if p.target == P2P_TIER_TARGET]
    spec = ActorSpec(plan.name, plan.target, nats_url, plan.kwargs, kind=plan.kind)
    supervisor = Supervisor([spec], status_bus=bus, namespace=config.bus_config.namespace)
    await supervisor.start()
    await supervisor.wait_for(plan.name, ChildState.RUNNING, timeout=60)
    return supervisor


async def _kill_at_first_read(bus: Bus, built: EngineStack, supervisor: Supervisor) -> Any:
    """An event set once the first ``PeerRead`` for host A's p2p tier was seen and its
    process SIGKILLed."""
    name = _tier(built, "P2PTierActor").actor_id
    killed = asyncio.Event()

    async def on_read(msg: Msg) -> None:
        pid = supervisor.pid(name)
        if not killed.is_set() and pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed.set()

    await bus.subscribe(
        Subjects(built.engines[0].config.bus_config.namespace).tier_peer_reads(name), on_read
    )
    return killed
