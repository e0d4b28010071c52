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
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from shoal.bus.base import Bus
from shoal.bus.codec import Codec, encode
from shoal.bus.messages.offload import (
    KVLayout,
    RegionRef,
    TierAttach,
    TierAttached,
    TierJobDone,
    TierLookup,
    TierLookupReply,
    TierPrepareStore,
    TierPromote,
    TierRelease,
    TierReply,
    TierStoreSlots,
)
from shoal.bus.messages.p2p import PeerHeld, PeerLookup
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import Actor, call
from shoal.config.deployment import KVTransferConfig, P2PTierConfig
from shoal.tiers.cpu.actor import CpuTierActor
from shoal.tiers.cpu.region import SharedRegion
from shoal.tiers.p2p import channel as p2p_channel
from shoal.tiers.p2p import serving as p2p_serving
from shoal.tiers.p2p.actor import P2PTierActor
from tests.fixtures.nats import BusFactory
from tests.integration.conditions import wait_for as wait_until

LIMIT_S = 10.0
LAYOUT = KVLayout("tiny", 1, 2, 1, 4, "float32", 1, 1)  # 64-byte slots
K = [bytes([i + 1]) * 16 + b"\0\0\0\0" for i in range(8)]
_REPLY: Codec[TierReply] = Codec(TierReply)


def p2p(direct: bool = True, **options: Any) -> P2PTierConfig:
    """A p2p tier whose direct stream (if ``direct``) listens on loopback."""
    return P2PTierConfig(direct_transfer=direct, data_host="127.0.0.1", **options)


def payload(key: bytes) -> bytes:
    return (key * LAYOUT.slot_bytes)[: LAYOUT.slot_bytes]


class Host:
    """One host: its CPU tier with a p2p secondary, and an engine core's side of the protocol."""

    def __init__(self, bus: Bus, name: str, namespace: str, directory: Path) -> None:
        self.bus, self.name, self.namespace, self.directory = bus, name, namespace, directory
        self.owner = f"engine-{name}/1"
        self.actors: list[Actor] = []

    async def start(
        self, config: P2PTierConfig, cpu_options: dict[str, Any], **actor_options: Any
    ) -> None:
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
            sweep_interval_s=0.2,  # a refusing secondary is attached again soon
            secondary_retry_s=0.3,
            drain_timeout_s=0.5,
            **cpu_options,
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
        self,
        name: str,
        config: P2PTierConfig | None = None,
        cpu_options: dict[str, Any] | None = None,
        **actor_options: Any,
    ) -> Host:
        """A host (the CPU tier's budgets are the defaults': 0.5 s for one secondary's
        answer, 1 s for a lookup); its served sessions outlive the test unless
        ``session_ttl_s`` says less (so pins seen handed back were handed back by the
        session's end)."""
        host = Host(await self.bus_factory(), name, self.namespace, self.directory)
        actor_options.setdefault("session_ttl_s", 600.0)
        await host.start(config or p2p(), cpu_options or {}, **actor_options)
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


TRANSFERS = pytest.mark.parametrize("direct", [True, False], ids=["stream", "bus-reads"])


@TRANSFERS
async def test_a_miss_is_pulled_from_the_peer_holding_the_prefix(
    hosts: Hosts, direct: bool
) -> None:
    a, b = await hosts.add("a", p2p(direct)), await hosts.add("b", p2p(direct))
    await a.store(*K[:4])
    found = await b.lookup(*K[:5])
    assert b.read(found.slot_ids) == [payload(k) for k in K[:4]]
    counters = b.p2p.counters
    assert (counters.num_rounds, counters.num_chunks_loaded) == (1, 4)
    assert counters.num_chunks_streamed == (4 if direct else 0)
    assert counters.num_bytes_pulled == 4 * LAYOUT.slot_bytes
    assert a.p2p.serving.num_chunks_served == 4
    await wait_for(lambda: not a.pins_for_peers(), "the peer's pins handed back")
    assert b.tier.books is not None and b.tier.books.counters.num_promoted == 4
    again = await b.lookup(*K[:4])  # promoted: held on b's own host now
    assert b.read(again.slot_ids) == [payload(k) for k in K[:4]]
    assert counters.num_rounds == 1


async def test_the_longest_prefix_wins_and_every_other_session_ends(hosts: Hosts) -> None:
    a, b, c, d = [await hosts.add(name) for name in "abcd"]
    await wait_for(lambda: len(b.p2p.peers.expected()) == 3, "b heard every peer")
    await a.store(*K[:2])
    await c.store(*K[:4])
    await d.store(*K[:4])  # as long as c's: only one of them is pulled from
    found = await b.lookup(*K[:6])
    assert b.read(found.slot_ids) == [payload(k) for k in K[:4]]
    served = [h.p2p.serving.num_chunks_served for h in (a, c, d)]
    assert served[0] == 0 and sorted(served[1:]) == [0, 4]
    assert all(h.p2p.serving.num_sessions_served == 1 for h in (a, c, d))  # each pinned
    await wait_for(lambda: not any(h.pins_for_peers() for h in (a, c, d)), "every pin back")
    assert b.p2p.peers.expected() == {h.p2p.actor_id for h in (a, c, d)}  # none missed


async def test_a_host_alone_misses_at_once(hosts: Hosts) -> None:
    b = await hosts.add("b")
    assert (await b.lookup(K[0])).slot_ids == []
    assert b.p2p.counters.num_rounds == 0  # no peer heard of: no round waited for


async def test_nothing_held_by_any_peer_is_a_miss(hosts: Hosts) -> None:
    a, b = await hosts.add("a"), await hosts.add("b")
    await wait_for(lambda: b.p2p.peers.expected(), "b heard a")
    await a.store(K[1])  # not the prefix's first chunk
    assert (await b.lookup(K[0], K[1])).slot_ids == []
    assert (b.p2p.counters.num_rounds, b.p2p.counters.num_round_hits) == (1, 0)
    assert not a.pins_for_peers()


@TRANSFERS
async def test_a_peer_that_stalls_mid_transfer_costs_the_rest_in_time(
    hosts: Hosts, direct: bool
) -> None:
    """Under the CPU tier's default budget: the chunk that arrived is kept, the answer comes
    while the CPU tier still waits (the link stays attached), the rest is a miss."""
    a, b = await hosts.add("a", p2p(direct)), await hosts.add("b", p2p(direct))
    await a.store(*K[:4])
    chunk = a.p2p.serving.chunk

    async def stall_after_the_first(session: str, index: int) -> Any:
        if index >= 1:
            await asyncio.Event().wait()  # never answers
        return await chunk(session, index)

    a.p2p.serving.chunk = stall_after_the_first  # type: ignore[method-assign]
    found = await b.lookup(*K[:4])
    assert b.read(found.slot_ids) == [payload(K[0])]
    assert b.tier.links[0].is_attached
    assert b.p2p.counters.num_chunks_loaded == 1 and b.p2p.counters.num_load_failures == 3
    assert b.tier.books is not None and b.tier.books.counters.num_promote_failures == 3


@TRANSFERS
async def test_a_damaged_chunk_ends_the_run_before_it(
    hosts: Hosts, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await hosts.add("a", p2p(direct)), await hosts.add("b", p2p(direct))
    await a.store(*K[:3])
    module = p2p_channel if direct else p2p_serving
    real_head = module.pack_head

    def damaged_on_the_way(key: bytes, data: Any) -> bytes:
        head = real_head(key, data)
        if key != K[1]:
            return head
        return real_head(key, bytes(b ^ 0xFF for b in bytes(data)))  # another payload's digest

    monkeypatch.setattr(module, "pack_head", damaged_on_the_way)
    found = await b.lookup(*K[:3])
    assert b.read(found.slot_ids) == [payload(K[0])]
    assert b.p2p.counters.num_chunks_corrupt == 1
    await wait_for(lambda: not a.pins_for_peers(), "the peer's pins handed back")


async def test_large_chunks_cross_the_bus_in_pieces(hosts: Hosts, bus_kind: str) -> None:
    if bus_kind != "memory":
        pytest.skip("the in-memory bus's payload limit is set per bus")
    made = hosts.bus_factory

    async def small_payloads(**options: Any) -> Bus:
        return await made(max_payload=48, **options)

    hosts.bus_factory = small_payloads
    a, b = await hosts.add("a", p2p(False)), await hosts.add("b", p2p(False))
    await a.store(*K[:3])
    found = await b.lookup(*K[:3])
    assert b.read(found.slot_ids) == [payload(k) for k in K[:3]]


async def test_a_session_its_requester_never_ends_is_renewed_then_handed_back(
    hosts: Hosts,
) -> None:
    a = await hosts.add("a", cpu_options={"lease_s": 1.5}, sweep_interval_s=0.1, session_ttl_s=3.0)
    await a.store(*K[:2])
    lookup = PeerLookup("a-vanished-peer", "s1", LAYOUT, K[:2])
    await a.bus.publish(a.p2p.subjects.tier_peers(), encode(lookup))
    await wait_for(lambda: a.p2p.serving.num_sessions_served == 1, "the session served")
    await wait_for(lambda: a.p2p.serving.num_renewals >= 20, "renewed past the CPU lease")
    assert a.pins_for_peers()
    assert a.tier.books is not None and a.tier.books.counters.num_pins_expired == 0
    await wait_for(lambda: not a.pins_for_peers(), "the expired session's pins back")
    assert a.p2p.serving.num_sessions_expired == 1


async def test_a_promotion_too_late_to_pull_still_ends_the_session(hosts: Hosts) -> None:
    a, b = await hosts.add("a"), await hosts.add("b")
    await wait_for(lambda: b.p2p.peers.expected(), "b heard a")
    await a.store(*K[:2])
    assert await b.p2p._ask_peers(K[:2]) == 2
    assert a.pins_for_peers()
    late = TierPromote(b.region, K[:2], [0, 1], time.time() - 1)
    reply = await b.p2p._promote(late)
    assert isinstance(reply, TierJobDone) and reply.failed_keys == K[:2]
    await wait_for(lambda: not a.pins_for_peers(), "the session ended")


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
    assert answers[1].data_address.startswith("127.0.0.1:")  # where its stream listens
    assert a.p2p.serving.num_sessions_served == 1


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
        tier_config=p2p(),
        cpu_tier_id=b.tier.actor_id,
        namespace=b.namespace,
        drain_timeout_s=0.5,
    )
    await fresh.start()
    b.actors.append(fresh)
    assert (await b.lookup(*K[:2])).slot_ids == []  # refused: the link detaches
    link = b.tier.links[0]
    await wait_for(lambda: link.is_attached and fresh.layout == LAYOUT, "attached again")
    await wait_for(lambda: fresh.peers.expected(), "the fresh tier heard its peer")
    found = (await b.lookup(*K[:2])).slot_ids
    assert b.read(found) == [payload(k) for k in K[:2]]


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
    await wait_for(lambda: b.p2p.peers.expected(), "b heard a")
    await a.store(*K[:2])
    reply = await b.ask(TierLookup(b.owner, K[:2], ["cpu", "fs", "obj"]))  # kv_load_tiers
    assert isinstance(reply, TierLookupReply) and reply.slot_ids == []
    assert b.p2p.counters.num_rounds == 0
    assert len((await b.lookup(*K[:2])).slot_ids) == 2  # p2p allowed (all tiers)
