"""The object-store tier across hosts, through the real actors on a real nats-server: two hosts
(each its own CPU tier, object tier, worker and engine core) in one namespace share the
deployment's bucket. A conversation prefilled on host A goes on on host B, whose CPU tier is
empty: B's prefix comes from the objects A's tier put (B started after A stored, or already
running when A stored), and the greedy outputs equal recompute (offload off). Damaged objects
are a miss: B recomputes the right tokens, counts them corrupt and removes them. The
nats-server restarted (same JetStream store) while returning turns load from the object tier:
every request completes with the right tokens (resumed by the engine client), and the object
tier loads again afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from shoal.bus.buckets import ObjectEntry, ObjectStore
from shoal.bus.nats_ops.server import NatsServer
from shoal.bus.transport.nats_bus import NatsBus
from shoal.engine.recovery.actor import RecoveryControllerActor
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import EngineStack, engine_stack
from tests.integration.offload_hosts import (
    OBJ_TIER,
    Host,
    fresh_cpu_tier,
    reference_turns,
    start_host,
)
from tests.integration.offload_workload import (
    BLOCK_SIZE,
    FIRST_TURNS,
    NUM_BLOCKS,
    Turns,
    first_turns,
    offload_options,
    second_turns,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.asyncio]

NUM_PROMPT_CHUNKS = sum(len(p) // BLOCK_SIZE for p in FIRST_TURNS)  # what A's turns store
NUM_RETURNING = 4 * 8  # chunks the returning turns can load, at least (8 blocks each)
_namespaces = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return tiny_checkpoint("llama")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(model_dir: Path) -> Turns:
    return await reference_turns(model_dir)


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[NatsBus]:
    bus = NatsBus([nats_url])
    await bus.connect()
    yield bus
    await bus.close()


async def stored_on(host: Host, num_chunks: int) -> None:
    """Once the host's turns reached its object tier."""
    obj = host.tier("ObjTierActor")
    await wait_for(lambda: obj.load()["num_chunks_stored"] >= num_chunks, 30, "stored")


@pytest.mark.parametrize("b_starts", ["after-a-stored", "before-a-stored"])
async def test_a_conversation_goes_on_on_another_host(
    bus: NatsBus, model_dir: Path, reference: Turns, b_starts: str
) -> None:
    namespace = f"objhosts{next(_namespaces)}"
    hosts = [await start_host(bus, model_dir, namespace, "ha")]
    try:
        if b_starts == "before-a-stored":  # B's tier attached to an empty bucket
            hosts.append(await start_host(bus, model_dir, namespace, "hb"))
        answers = await hosts[0].first_turns()
        await stored_on(hosts[0], NUM_PROMPT_CHUNKS)
        if b_starts == "after-a-stored":  # B's tier finds A's objects in the listing
            hosts.append(await start_host(bus, model_dir, namespace, "hb"))
        b = hosts[1]
        second = await b.second_turns(answers)
        stats = await b.settled_stats()
        cpu, obj = b.tier("CpuTierActor").load(), b.tier("ObjTierActor").load()
    finally:
        for host in hosts:
            await host.stop()
    assert answers + second == reference
    assert cpu["num_promoted"] >= NUM_RETURNING and obj["num_chunks_loaded"] >= NUM_RETURNING
    assert stats.kv_offload_hits >= NUM_RETURNING * BLOCK_SIZE
    if b_starts == "before-a-stored":
        assert obj["num_chunks_adopted"] >= NUM_RETURNING  # found by asking the store
    else:
        assert obj["num_chunks_adopted"] == 0  # found in the listing at attach


async def damage_every_object(store: ObjectStore) -> list[ObjectEntry]:
    """Flip the last payload byte of every object, through the object store (its own digest
    fits the new bytes: only the chunk's checksum can tell); the damaged objects' entries."""
    for entry in await store.list():
        data = await store.get(entry.name)
        assert data is not None
        damaged = bytearray(data)
        damaged[-1] ^= 0xFF
        await store.put(entry.name, bytes(damaged))
    return await store.list()


async def test_damaged_objects_are_recomputed_and_removed(
    bus: NatsBus, model_dir: Path, reference: Turns
) -> None:
    namespace = f"objhosts{next(_namespaces)}"
    hosts = [await start_host(bus, model_dir, namespace, "ha")]
    try:
        answers = await hosts[0].first_turns()
        await stored_on(hosts[0], NUM_PROMPT_CHUNKS)
        store = await bus.open_object_store(f"shoal_kv_{namespace}")
        damaged = await damage_every_object(store)
        hosts.append(await start_host(bus, model_dir, namespace, "hb"))
        b = hosts[1]
        b.tier("ObjTierActor")._store_chunk = store_nothing  # what is left is what A put
        second = await b.second_turns(answers)
        await b.settled_stats()
        obj = b.tier("ObjTierActor").load()
        left = await store.list()
    finally:
        for host in hosts:
            await host.stop()
    assert answers + second == reference
    assert len(damaged) == obj["num_chunks_corrupt"] == NUM_PROMPT_CHUNKS
    assert obj["num_chunks_loaded"] == 0 and left == []  # every damaged object read, removed


async def store_nothing(store: object, io: object) -> Exception:
    return OSError("this host's object tier writes nothing in this test")


async def test_a_nats_server_restart_mid_run(
    fresh_nats_server: NatsServer, model_dir: Path, reference: Turns
) -> None:
    """The returning turns run at once, their prefixes promoted from the object tier (the CPU
    tier restarted empty), and the server stops and starts again under them."""
    bus = NatsBus([fresh_nats_server.url])
    await bus.connect()
    options = offload_options(secondary_tiers=[OBJ_TIER])
    ft = {"enable_fault_tolerance": True, "request_resume_timeout_s": 60.0}
    try:
        async with stack_with_recovery(bus, model_dir, options, ft) as built:
            answers = await first_turns(built.client)
            obj = next(t for t in built.tiers if type(t).__name__ == "ObjTierActor")
            await wait_for(lambda: obj.load()["num_chunks_stored"] >= NUM_PROMPT_CHUNKS, 30, "")
            config = built.engines[0].config
            await fresh_cpu_tier(bus, config, built.tiers)
            running = asyncio.gather(second_turns(built.client, answers, "-cut"))
            await wait_for(lambda: loading(built, obj), 30, "a returning turn running")
            fresh_nats_server.stop()  # at once: the engine core holds that request now
            fresh_nats_server.start()
            (cut,) = await asyncio.wait_for(running, 120)
            num_resumed = built.client.resumptions.num_resumptions_total
            loaded = obj.load()["num_chunks_loaded"]
            fresh = await fresh_cpu_tier(bus, config, built.tiers)
            again = await second_turns(built.client, answers, "-again")
            promoted = fresh.load()["num_promoted"]
            reloaded = obj.load()["num_chunks_loaded"] - loaded
    finally:
        await bus.close()
    assert answers + cut == reference and answers + again == reference
    assert num_resumed >= 1 and bus.num_reconnects == 1  # cut by the restart, resumed
    assert promoted >= NUM_RETURNING and reloaded >= NUM_RETURNING


def loading(built: EngineStack, obj: Any) -> bool:
    """A returning turn is in the engine core, its prefix promoted from the object tier."""
    core = built.engines[0].core
    return (
        core is not None and bool(core.scheduler.requests) and obj.load()["num_chunks_loaded"] > 0
    )


@contextlib.asynccontextmanager
async def stack_with_recovery(
    bus: NatsBus, model_dir: Path, options: dict[str, Any], ft: dict[str, Any]
) -> AsyncIterator[EngineStack]:
    """An engine stack with fault tolerance and its recovery controller (which retries the
    engine core a lost connection faulted)."""
    async with engine_stack(
        bus,
        model_dir,
        namespace=f"objrestart{next(_namespaces)}",
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=256,
        fault_tolerance_config=ft,
        **options,
    ) as built:
        controller = RecoveryControllerActor(bus, config=built.engines[0].config)
        await controller.start()
        try:
            yield built
        finally:
            await controller.stop()
