"""The peer-to-peer tier between "hosts" (each a CPU tier with its own region and a p2p tier
actor, on its own bus connection) over the in-memory bus and a real NATS server, driven as
engine cores would drive their CPU tiers: a miss on one host is found in another host's CPU
tier in one round and pulled byte for byte; the longest holder wins; a peer that dies or sends
a damaged chunk mid-transfer costs the rest of the prefix, never a wrong byte; every pin taken
for a peer is handed back (at the session's end, or when its requester never ends it); nothing
is cascaded to a p2p tier."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from shoal.bus.actor import Actor, call
from shoal.bus.base import Bus, Msg
from shoal.bus.codec import Codec, encode
from shoal.bus.messages.config import KVTransferConfig, P2PTierConfig
from shoal.bus.messages.offload import (
    KVLayout,
    RegionRef,
    TierAttach,
    TierAttached,
    TierJobDone,
    TierLookup,
    TierLookupReply,
    TierPrepareStore,
    TierRelease,
    TierReply,
    TierStoreSlots,
)
from shoal.bus.messages.p2p import PeerHeld, PeerLookup
from shoal.tiers import p2p_actor
from shoal.tiers.cpu_actor import CpuTierActor
from shoal.tiers.p2p_actor import P2PTierActor
from shoal.tiers.region import SharedRegion
from tests.fixtures.nats import BusFactory
from tests.integration.conditions import wait_for as wait_until

LIMIT_S = 10.0
LAYOUT = KVLayout("tiny", 1, 2, 1, 4, "float32", 1, 1)  # 64-byte slots
K = [bytes([i + 1]) * 16 + b"\0\0\0\0" for i in range(8)]
_REPLY: Codec[TierReply] = Codec(TierReply)


def payload(key: bytes) -> bytes:
    return (key * LAYOUT.slot_bytes)[: LAYOUT.slot_bytes]


class Host:
    """One host: its CPU tier with a p2p secondary, and an engine core's side of the protocol."""

    def __init__(self, bus: Bus, name: str, namespace: str, directory: Path) -> None:
        self.bus, self.name, self.namespace, self.directory = bus, name, namespace, directory
        self.owner = f"engine-{name}/1"
        self.actors: list[Actor] = []

    async def start(self, config: P2PTierConfig, **actor_options: Any) -> None:
        kv = KVTransferConfig(
            kv_connector="OffloadingConnector",
            cpu_bytes_to_use=8 * LAYOUT.slot_bytes,
            secondary_tiers=(config,),
            cpu_tier_id=f"kv-{self.name}",
        )
        self.tier = CpuTierActor(
            self.bus,
            kv_config=kv,
            namespace=self.namespace,
            region_directory=self.directory,
            secondary_timeout_s=1.0,
            drain_timeout_s=0.5,
        )
        self.p2p = P2PTierActor(
            self.bus,
            kv.secondary_tier_ids[0],
            tier_config=config,
            cpu_tier_id=kv.cpu_tier_id,
            namespace=self.namespace,
            drain_timeout_s=0.5,
            **actor_options,
        )
        for actor in (self.p2p, self.tier):
            await actor.start()
            self.actors.append(actor)
        reply = await self.ask(TierAttach(LAYOUT))
        assert isinstance(reply, TierAttached), reply
        self.region: RegionRef = reply.region

    async def ask(self, request: Any) -> Any:
        subject = self.tier.subjects.tier_in(self.tier.actor_id)
        return await call(self.bus, subject, request, _REPLY, timeout=LIMIT_S)

    async def store(self, *keys: bytes) -> None:
        slots = await self.ask(TierPrepareStore(self.owner, list(keys)))
        assert isinstance(slots, TierStoreSlots) and slots.accepted, slots
        region = SharedRegion.attach(self.region)
        try:
            for key, slot_id in zip(slots.keys, slots.slot_ids, strict=True):
                region.slot(slot_id)[:] = payload(key)
        finally:
            region.close()
        done = await self.ask(TierRelease(self.owner, stored_keys=slots.keys))
        assert isinstance(done, TierJobDone) and done.done_keys == slots.keys, done

    async def lookup(self, *keys: bytes) -> TierLookupReply:
        reply = await self.ask(TierLookup(self.owner, list(keys)))
        assert isinstance(reply, TierLookupReply), reply
        return reply

    def read(self, slot_ids: list[int]) -> list[bytes]:
        region = SharedRegion.attach(self.region)
        try:
            return [bytes(region.slot(s)) for s in slot_ids]
        finally:
            region.close()

    def pins_for_peers(self) -> bool:
        """Whether this host's CPU tier still holds pins its p2p tier took for peers."""
        assert self.tier.books is not None
        return self.p2p.owner in self.tier.books.leases.owners()


class Hosts:
    def __init__(self, bus_factory: BusFactory, directory: Path) -> None:
        self.bus_factory, self.directory = bus_factory, directory
        self.namespace = f"p2p{secrets.token_hex(4)}"
        self.hosts: list[Host] = []

    async def add(
        self, name: str, config: P2PTierConfig | None = None, **actor_options: Any
    ) -> Host:
        """A host; its served sessions outlive the test unless ``session_ttl_s`` says less
        (so pins seen handed back were handed back by the session's end)."""
        host = Host(await self.bus_factory(), name, self.namespace, self.directory)
        actor_options.setdefault("session_ttl_s", 600.0)
        await host.start(config or P2PTierConfig(), **actor_options)
        self.hosts.append(host)
        return host


@pytest.fixture
async def hosts(bus_factory: BusFactory, tmp_path: Path) -> AsyncIterator[Hosts]:
    made = Hosts(bus_factory, tmp_path)
    yield made
    for host in reversed(made.hosts):
        for actor in reversed(host.actors):
            await actor.stop()


async def wait_for(condition: Any, what: str) -> None:
    await wait_until(condition, LIMIT_S, what)


async def test_a_miss_is_pulled_from_the_peer_holding_the_prefix(hosts: Hosts) -> None:
    a, b = await hosts.add("a"), await hosts.add("b")
    await a.store(*K[:4])
    found = await b.lookup(*K[:5])
    assert b.read(found.slot_ids) == [payload(k) for k in K[:4]]
    assert (b.p2p.counters.num_rounds, b.p2p.counters.num_chunks_loaded) == (1, 4)
    assert b.p2p.counters.num_bytes_pulled == 4 * LAYOUT.slot_bytes
    assert a.p2p.counters.num_chunks_served == 4
    await wait_for(lambda: not a.pins_for_peers(), "the peer's pins handed back")
    assert b.tier.books is not None and b.tier.books.counters.num_promoted == 4
    again = await b.lookup(*K[:4])  # promoted: held on b's own host now
    assert b.read(again.slot_ids) == [payload(k) for k in K[:4]]
    assert b.p2p.counters.num_rounds == 1


async def test_the_longest_prefix_wins_and_the_other_sessions_end(hosts: Hosts) -> None:
    a, b, c = await hosts.add("a"), await hosts.add("b"), await hosts.add("c")
    await a.store(*K[:2])
    await c.store(*K[:4])
    found = await b.lookup(*K[:6])
    assert b.read(found.slot_ids) == [payload(k) for k in K[:4]]
    assert (a.p2p.counters.num_chunks_served, c.p2p.counters.num_chunks_served) == (0, 4)
    assert a.p2p.counters.num_sessions_served == 1  # it pinned, then was told to let go
    await wait_for(lambda: not a.pins_for_peers() and not c.pins_for_peers(), "pins back")


async def test_nothing_held_by_any_peer_is_a_miss(hosts: Hosts) -> None:
    a, b = await hosts.add("a"), await hosts.add("b")
    await a.store(K[1])  # not the prefix's first chunk
    assert (await b.lookup(K[0], K[1])).slot_ids == []
    assert (b.p2p.counters.num_rounds, b.p2p.counters.num_round_hits) == (1, 0)
    assert not a.pins_for_peers()


async def test_a_peer_that_dies_mid_transfer_costs_the_rest_never_a_wrong_byte(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = await hosts.add("a")
    b = await hosts.add("b", P2PTierConfig(transfer_window=1, read_timeout_s=0.5))
    await a.store(*K[:4])
    serve = a.p2p._serve_read

    async def serve_then_die(session: str, index: int) -> bytes:
        if index == 0:
            return await serve(session, index)
        await a.p2p.stop("killed")  # nothing more is answered
        raise ConnectionError("gone")

    monkeypatch.setattr(a.p2p, "_serve_read", serve_then_die)
    found = await b.lookup(*K[:4])
    assert b.read(found.slot_ids) == [payload(K[0])]
    assert b.p2p.counters.num_chunks_loaded == 1
    assert b.p2p.counters.num_load_failures == 3
    assert b.tier.books is not None and b.tier.books.counters.num_promote_failures == 3
    assert (await b.lookup(*K[:4])).slot_ids[:1] == found.slot_ids  # nothing else is held


async def test_a_damaged_chunk_ends_the_run_before_it(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await hosts.add("a"), await hosts.add("b")
    await a.store(*K[:3])
    real_part = p2p_actor._part_of

    def damaged(slot: memoryview, key: bytes) -> bytes:
        part = bytearray(real_part(slot, key))
        if key == K[1]:
            part[-1] ^= 0xFF
        return bytes(part)

    monkeypatch.setattr(p2p_actor, "_part_of", damaged)
    found = await b.lookup(*K[:3])
    assert b.read(found.slot_ids) == [payload(K[0])]
    assert b.p2p.counters.num_chunks_corrupt == 1
    await wait_for(lambda: not a.pins_for_peers(), "the peer's pins handed back")


async def test_a_session_its_requester_never_ends_is_handed_back(hosts: Hosts) -> None:
    a = await hosts.add("a", session_ttl_s=0.3)
    await a.store(*K[:2])
    lookup = PeerLookup("a-vanished-peer", "s1", LAYOUT, K[:2])
    await a.bus.publish(a.p2p.subjects.tier_peers(), encode(lookup))
    await wait_for(lambda: a.p2p.counters.num_sessions_served == 1, "the session served")
    assert a.pins_for_peers()
    await wait_for(lambda: not a.pins_for_peers(), "the expired session's pins back")
    assert a.p2p.counters.num_sessions_expired == 1


async def test_a_peer_of_another_layout_holds_nothing(hosts: Hosts) -> None:
    a = await hosts.add("a")
    await a.store(*K[:2])
    answers: list[PeerHeld] = []

    async def collect(msg: Msg) -> None:
        answers.append(Codec(PeerHeld).decode(msg.data))

    subjects = a.p2p.subjects
    await a.bus.subscribe(subjects.tier_peer_answers("somebody"), collect)
    for session, layout in (("other", KVLayout("other", 1, 2, 1, 4, "float32", 1, 1)),
                            ("same", LAYOUT)):  # fmt: skip
        lookup = PeerLookup("somebody", session, layout, K[:2])
        await a.bus.publish(subjects.tier_peers(), encode(lookup))
        num_expected = len(answers) + 1
        await wait_for(lambda n=num_expected: len(answers) == n, f"{session} answered")
    assert [(h.session, h.num_leading) for h in answers] == [("other", 0), ("same", 2)]
    assert a.p2p.counters.num_sessions_served == 1


async def test_nothing_is_cascaded_to_a_peer_tier(hosts: Hosts) -> None:
    a = await hosts.add("a")
    assert a.tier.links and not a.tier.cascade_links
    await a.store(*K[:3])
    await a.lookup(*K[:3])  # a round trip after the store's cascades were sent
    assert a.tier.books is not None
    counters = a.tier.books.counters
    assert (counters.num_cascaded, counters.num_cascade_failures) == (0, 0)
    assert counters.num_cascade_dropped == 0


async def test_a_restarted_p2p_tier_is_attached_again_and_finds_peers(hosts: Hosts) -> None:
    a, b = await hosts.add("a"), await hosts.add("b")
    await a.store(*K[:2])
    await b.p2p.stop("restarted")
    fresh = P2PTierActor(
        b.bus,
        b.p2p.actor_id,
        tier_config=P2PTierConfig(),
        cpu_tier_id=b.tier.actor_id,
        namespace=b.namespace,
        drain_timeout_s=0.5,
    )
    await fresh.start()
    b.actors.append(fresh)
    found: list[int] = []
    for _ in range(50):  # bounded: the CPU tier attaches a refusing secondary again in 1 s
        found = (await b.lookup(*K[:2])).slot_ids
        if found:
            break
        await asyncio.sleep(0.1)
    assert b.read(found) == [payload(k) for k in K[:2]]
    assert fresh.layout == LAYOUT


async def test_peers_that_start_know_each_other_and_a_dead_one_is_not_waited_for(
    hosts: Hosts,
) -> None:
    a, b = await hosts.add("a"), await hosts.add("b")
    await wait_for(lambda: a.p2p.peers.expected() == {b.p2p.actor_id}, "a heard b's hello")
    await wait_for(lambda: b.p2p.peers.expected() == {a.p2p.actor_id}, "a answered the hello")
    await a.p2p.stop("gone")
    assert (await b.lookup(*K[:2])).slot_ids == []
    assert b.p2p.peers.expected() == frozenset()  # it missed the round


async def test_a_request_that_may_not_load_from_peers_asks_none(hosts: Hosts) -> None:
    a, b = await hosts.add("a"), await hosts.add("b")
    await a.store(*K[:2])
    reply = await b.ask(TierLookup(b.owner, K[:2], ["cpu", "fs", "obj"]))  # kv_load_tiers
    assert isinstance(reply, TierLookupReply) and reply.slot_ids == []
    assert b.p2p.counters.num_rounds == 0
    assert len((await b.lookup(*K[:2])).slot_ids) == 2  # p2p allowed (all tiers)
