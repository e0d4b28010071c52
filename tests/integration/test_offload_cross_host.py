"""KV offload across hosts through the peer-to-peer tier, with the real actors on the in-memory
bus and on a real NATS server: two hosts of one deployment (``offload_hosts``: each its own CPU
tier, p2p tier, worker and engine core). Conversations are prefilled on host A and continue on
host B, whose own tiers are empty: B's misses are found in A's CPU tier and pulled, over the
direct stream or over the bus. Greedy outputs equal recompute; the counters show the loads. A
peer SIGKILLed mid-transfer costs recomputes, never a wrong token."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from shoal.bus.base import Bus
from shoal.bus.msg import Msg
from shoal.bus.runtime.supervisor import ActorSpec, ChildState, Supervisor
from shoal.bus.transport.nats_bus import NatsBus
from shoal.deploy.deployment import P2P_TIER_TARGET, plan_tiers
from tests.integration.conditions import wait_for
from tests.integration.offload_hosts import Host, reference_turns, start_host
from tests.integration.offload_workload import BLOCK_SIZE, Turns

pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio]

NUM_RETURNING = 4 * 8  # chunks the returning turns can load, at least (8 blocks each)
_namespaces = itertools.count()


def p2p_tier(direct: bool) -> list[dict[str, Any]]:
    """A p2p tier; its direct stream (if ``direct``) on loopback."""
    return [{"type": "p2p", "direct_transfer": direct, "data_host": "127.0.0.1"}]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return tiny_checkpoint("llama")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(model_dir: Path) -> Turns:
    return await reference_turns(model_dir)


async def two_hosts(bus_a: Bus, bus_b: Bus, model_dir: Path, direct: bool) -> list[Host]:
    """Hosts A and B of a fresh namespace, once B's p2p tier has heard A's."""
    namespace, tiers = f"xhost{next(_namespaces)}", p2p_tier(direct)
    hosts = [await start_host(bus_a, model_dir, namespace, "ha", secondary_tiers=tiers)]
    hosts.append(await start_host(bus_b, model_dir, namespace, "hb", secondary_tiers=tiers))
    peer_a, p2p_b = hosts[0].tier("P2PTierActor").actor_id, hosts[1].tier("P2PTierActor")
    await wait_for(lambda: peer_a in p2p_b.peers.expected(), 60, "B heard A's p2p tier")
    return hosts


@pytest.mark.parametrize("direct", [True, False], ids=["stream", "bus-reads"])
async def test_a_conversation_prefilled_on_one_host_continues_on_another_through_p2p(
    bus_factory, model_dir, reference, direct
) -> None:  # type: ignore[no-untyped-def]
    a, b = await two_hosts(await bus_factory(), await bus_factory(), model_dir, direct)
    try:
        answers = await a.first_turns()
        await a.settled_stats()
        second = await b.second_turns(answers)
        stats = await b.settled_stats()
        pulled, served = b.tier("P2PTierActor").load(), a.tier("P2PTierActor").load()
        promoted = b.tier("CpuTierActor").load()["num_promoted"]
    finally:
        await b.stop()
        await a.stop()
    assert answers + second == reference
    assert pulled["num_chunks_loaded"] >= NUM_RETURNING <= served["num_chunks_served"]
    assert pulled["num_chunks_streamed"] == (pulled["num_chunks_loaded"] if direct else 0)
    assert promoted == pulled["num_chunks_loaded"]
    assert stats.kv_offload_hits >= NUM_RETURNING * BLOCK_SIZE


async def test_a_peer_sigkilled_mid_transfer_costs_recomputes_not_wrong_tokens(
    nats_url, model_dir, reference
) -> None:  # type: ignore[no-untyped-def]
    """Host A's p2p tier runs in its own process and is SIGKILLed as soon as host B's first
    chunk read reaches it (chunks read over the bus, so the test sees the reads): B's
    promotion keeps what arrived whole, the rest is recomputed, and every returning
    conversation decodes the offload-off tokens (the supervisor restarts A's p2p tier
    meanwhile; A's CPU tier kept its chunks)."""
    bus_a, bus_b = NatsBus([nats_url]), NatsBus([nats_url])
    await bus_a.connect()
    await bus_b.connect()
    namespace = f"xhost{next(_namespaces)}"
    tiers = p2p_tier(direct=False)
    a = await start_host(bus_a, model_dir, namespace, "ha", secondary_tiers=tiers)
    supervisor = await p2p_tier_in_a_process(nats_url, bus_a, a)
    b = await start_host(bus_b, model_dir, namespace, "hb", secondary_tiers=tiers)
    try:
        peer_a, p2p_b = a.tier("P2PTierActor").actor_id, b.tier("P2PTierActor")
        await wait_for(lambda: peer_a in p2p_b.peers.expected(), 60, "B heard A's p2p tier")
        answers = await a.first_turns()
        await a.settled_stats()
        killed = await kill_at_first_read(bus_a, a, supervisor)
        second = await b.second_turns(answers)
        pulled = p2p_b.load()
        assert killed.is_set(), "a chunk read reached host A's p2p tier"
    finally:
        await b.stop()
        await supervisor.stop()
        await a.stop()
        await bus_b.close()
        await bus_a.close()
    assert answers + second == reference
    assert pulled["num_load_failures"] >= 1  # the transfer was cut


async def p2p_tier_in_a_process(nats_url: str, bus: Bus, host: Host) -> Supervisor:
    """Replace the host's in-process p2p tier with the same plan in a supervised process."""
    in_process = host.tier("P2PTierActor")
    await in_process.stop()
    (plan,) = [p for p in plan_tiers(host.config) if p.target == P2P_TIER_TARGET]
    spec = ActorSpec(plan.name, plan.target, nats_url, plan.kwargs, kind=plan.kind)
    supervisor = Supervisor([spec], status_bus=bus, namespace=host.config.bus_config.namespace)
    await supervisor.start()
    await supervisor.wait_for(plan.name, ChildState.RUNNING, timeout=60)
    return supervisor


async def kill_at_first_read(bus: Bus, host: Host, supervisor: Supervisor) -> asyncio.Event:
    """An event set once the first ``PeerRead`` for the host's p2p tier was seen and its
    process SIGKILLed."""
    p2p = host.tier("P2PTierActor")
    killed = asyncio.Event()

    async def on_read(msg: Msg) -> None:
        pid = supervisor.pid(p2p.actor_id)
        if not killed.is_set() and pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed.set()

    await bus.subscribe(p2p.subjects.tier_peer_reads(p2p.actor_id), on_read)
    return killed
