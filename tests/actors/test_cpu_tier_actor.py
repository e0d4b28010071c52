"""The CPU tier actor over the in-memory bus and a real NATS server, driven as an engine core
(request/reply) and its worker (bytes written to and read from the region through
``SharedRegion.attach``) would, with a stand-in secondary tier (bytes kept in a dict): stores
become hits with their bytes, pins protect chunks from eviction until released or expired, bad
layouts and budgets are refused, a restarted tier makes a new region, chunks round-trip through
a cascade and a promotion, a dead or slow secondary costs hits but never a prompt answer,
cascades past the bound are dropped while loads go on, and a lookup that meets another's
promotion waits for it (within its own budget) instead of promoting the same chunks again."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from shoal.bus.base import Bus
from shoal.bus.codec import Codec
from shoal.bus.messages.offload import (
    KVLayout,
    RegionRef,
    SecondaryInbound,
    TierAttach,
    TierAttached,
    TierCascade,
    TierError,
    TierHeld,
    TierJobDone,
    TierLookup,
    TierLookupReply,
    TierPrepareStore,
    TierPromote,
    TierRelease,
    TierRenew,
    TierReply,
    TierStoreSlots,
)
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import Actor, Inbox, call
from shoal.bus.runtime.run_actor import build_actor
from shoal.config.deployment import FsTierConfig, KVTransferConfig, ShoalConfig
from shoal.config.kv_transfer import BackpressureConfig
from shoal.tiers.books.backpressure import StoreBackpressure
from shoal.tiers.cpu.actor import CpuTierActor
from shoal.tiers.cpu.region import SharedRegion
from tests.fixtures.nats import BusFactory
from tests.integration.conditions import wait_for as wait_until

LIMIT_S = 10.0
ENGINE_PATIENCE_S = 2.0  # kv_lookup_timeout_s: an engine core gives up on a lookup then
LAYOUT = KVLayout("tiny", 1, 2, 1, 4, "float32", 1, 1)  # 64-byte slots
OWNER = "engine-0/1"
OTHER = "engine-1/1"  # another engine core
K = [bytes([i]) * 16 + b"\0\0\0\0" for i in range(16)]
_REPLY: Codec[TierReply] = Codec(TierReply)


async def wait_for(condition: Callable[[], object], what: str) -> None:
    await wait_until(condition, LIMIT_S, what)


def payload(key: bytes) -> bytes:
    return (key * LAYOUT.slot_bytes)[: LAYOUT.slot_bytes]


class SecondaryAttached(msgspec.Struct, tag="secondary_attached", array_like=True):
    """A reply the CPU tier does not know: any reply but an error means attached."""

    tier_id: str


class SecondaryDouble(Actor):
    """A secondary tier keeping chunks in a dict; ``hang_lookups`` and ``gate_cascades`` hold
    those requests until ``unblocked`` is set, ``hang_promotes`` until ``promotes_unblocked``
    is; ``cascade_delay_s`` makes every cascade that slow; ``promotes`` lists each promotion's
    keys as it came."""

    kind = "tier"

    def __init__(self, bus: Bus, tier_id: str, namespace: str) -> None:
        super().__init__(bus, tier_id, namespace=namespace, drain_timeout_s=0.2)
        self.chunks: dict[bytes, bytes] = {}
        self.hang_lookups = False
        self.gate_cascades = False
        self.hang_promotes = False
        self.unblocked = asyncio.Event()
        self.promotes_unblocked = asyncio.Event()
        self.promotes: list[list[bytes]] = []
        self.cascade_delay_s = 0.0  # a slow tier: each cascade takes this long
        self.num_lookups = 0
        self.num_cascades_started = 0
        self.deadlines: list[tuple[str, float, float]] = []  # (job, deadline, time it came)

    def inboxes(self) -> Sequence[Inbox]:
        return [
            Inbox(self.subjects.tier_in(self.actor_id), self.on_request, Codec(SecondaryInbound))
        ]

    async def on_request(self, request: Any, msg: Msg) -> Any:
        match request:
            case TierAttach():
                return SecondaryAttached(self.actor_id)
            case TierLookup(keys=keys):
                self.num_lookups += 1
                if self.hang_lookups:
                    await self.unblocked.wait()
                return TierHeld(self._num_leading(keys))
            case TierCascade(region=region, keys=keys, slot_ids=slot_ids):
                self.num_cascades_started += 1
                self.deadlines.append(("cascade", request.deadline, time.time()))
                if self.gate_cascades:
                    await self.unblocked.wait()
                await asyncio.sleep(self.cascade_delay_s)
                try:
                    with_region(region, lambda r: self._read(r, keys, slot_ids))
                except OSError:  # the CPU tier is gone (the test is over)
                    return TierJobDone(failed_keys=keys)
                return TierJobDone(done_keys=keys)
            case TierPromote(region=region, keys=keys, slot_ids=slot_ids):
                self.deadlines.append(("promote", request.deadline, time.time()))
                self.promotes.append(keys)
                if self.hang_promotes:
                    await self.promotes_unblocked.wait()
                done = keys[: self._num_leading(keys)]
                try:
                    with_region(region, lambda r: self._write(r, done, slot_ids))
                except OSError:  # the CPU tier is gone (the test is over)
                    return TierJobDone(failed_keys=keys)
                return TierJobDone(done_keys=done)

    def _num_leading(self, keys: list[bytes]) -> int:
        return next((i for i, key in enumerate(keys) if key not in self.chunks), len(keys))

    def _read(self, region: SharedRegion, keys: list[bytes], slot_ids: list[int]) -> None:
        for key, slot_id in zip(keys, slot_ids, strict=True):
            self.chunks[key] = bytes(region.slot(slot_id))

    def _write(self, region: SharedRegion, keys: list[bytes], slot_ids: list[int]) -> None:
        for key, slot_id in zip(keys, slot_ids, strict=False):
            region.slot(slot_id)[:] = self.chunks[key]


def with_region(ref: RegionRef, use: Callable[[SharedRegion], None]) -> None:
    region = SharedRegion.attach(ref)
    try:
        use(region)
    finally:
        region.close()


class Deployment:
    """One test's tier actors and an engine core's side of the protocol."""

    def __init__(self, bus: Bus, directory: Path) -> None:
        self.bus, self.directory = bus, directory
        self.namespace = f"ct{secrets.token_hex(4)}"
        self.actors: list[Actor] = []
        self.tier: CpuTierActor | None = None

    def kv_config(
        self, num_slots: int = 4, secondary: bool = False, num_secondaries: int = 1, **options: Any
    ) -> Any:
        tiers = (FsTierConfig(path=str(self.directory / "fs")),) * (num_secondaries * secondary)
        return KVTransferConfig(
            kv_connector="OffloadingConnector",
            cpu_bytes_to_use=num_slots * LAYOUT.slot_bytes,
            secondary_tiers=tiers,
            **options,
        )

    async def start_tier(self, kv: KVTransferConfig | ShoalConfig, **options: Any) -> CpuTierActor:
        options = {"secondary_timeout_s": 0.5, "secondary_retry_s": 60.0, **options}
        tier = CpuTierActor(
            self.bus,
            **({"config": kv} if isinstance(kv, ShoalConfig) else {"kv_config": kv}),
            namespace=self.namespace,
            region_directory=self.directory,
            drain_timeout_s=0.5,
            **options,
        )
        await tier.start()
        self.actors.append(tier)
        self.tier = tier
        return tier

    async def start_secondary(self, kv: KVTransferConfig, index: int = 0) -> SecondaryDouble:
        double = SecondaryDouble(self.bus, kv.secondary_tier_ids[index], self.namespace)
        await double.start()
        self.actors.append(double)
        return double

    async def ask(self, request: Any, timeout: float = LIMIT_S) -> Any:
        assert self.tier is not None
        subject = self.tier.subjects.tier_in(self.tier.actor_id)
        return await call(self.bus, subject, request, _REPLY, timeout=timeout)

    async def attach(self) -> RegionRef:
        reply = await self.ask(TierAttach(LAYOUT))
        assert isinstance(reply, TierAttached), reply
        return reply.region

    async def lookup(
        self,
        *keys: bytes,
        timeout: float = LIMIT_S,
        tiers: list[str] | None = None,
        owner: str = OWNER,
    ) -> TierLookupReply:
        reply = await self.ask(TierLookup(owner, list(keys), tiers), timeout)
        assert isinstance(reply, TierLookupReply), reply
        return reply

    async def store(self, region: RegionRef, *keys: bytes) -> TierStoreSlots:
        """Reserve, write as a worker would, report the copies done."""
        slots = await self.ask(TierPrepareStore(OWNER, list(keys)))
        assert isinstance(slots, TierStoreSlots) and slots.accepted, slots
        with_region(region, lambda r: write_slots(r, slots.keys, slots.slot_ids))
        done = await self.ask(TierRelease(OWNER, stored_keys=slots.keys))  # asked: acked
        assert isinstance(done, TierJobDone) and done.done_keys == slots.keys, done
        return slots

    async def release(self, owner: str = OWNER, **keys: Any) -> None:
        """As an engine core sends it: no reply expected."""
        assert self.tier is not None
        subject = self.tier.subjects.tier_in(self.tier.actor_id)
        await self.bus.publish(subject, Codec(TierRelease).encode(TierRelease(owner, **keys)))

    async def renew_for(self, seconds: float, renewal: TierRenew) -> None:
        """Send ``renewal`` every 0.1 s for ``seconds`` (what the engine core's link does)."""
        assert self.tier is not None
        subject = self.tier.subjects.tier_in(self.tier.actor_id)
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            await self.bus.publish(subject, Codec(TierRenew).encode(renewal))
            await asyncio.sleep(0.1)  # paces the renewals


def write_slots(region: SharedRegion, keys: list[bytes], slot_ids: list[int]) -> None:
    for key, slot_id in zip(keys, slot_ids, strict=True):
        region.slot(slot_id)[:] = payload(key)


def read_slots(ref: RegionRef, slot_ids: list[int]) -> list[bytes]:
    out: list[bytes] = []
    with_region(ref, lambda r: out.extend(bytes(r.slot(s)) for s in slot_ids))
    return out


@pytest.fixture
async def deployment(bus_factory: BusFactory, tmp_path: Path) -> AsyncIterator[Deployment]:
    d = Deployment(await bus_factory(), tmp_path)
    yield d
    for actor in reversed(d.actors):
        if isinstance(actor, SecondaryDouble):
            actor.unblocked.set()
            actor.promotes_unblocked.set()
        await actor.stop()


async def test_a_stored_chunk_is_a_pinned_hit_with_its_bytes(deployment):
    await deployment.start_tier(deployment.kv_config(num_slots=4))
    region = await deployment.attach()
    assert (region.num_slots, region.layout) == (4, LAYOUT)
    assert Path(region.path).parent == deployment.directory
    miss = await deployment.lookup(K[0], K[1])
    assert (miss.slot_ids, miss.num_pending, miss.generation) == ([], 0, region.generation)
    slots = await deployment.ask(TierPrepareStore(OWNER, [K[0], K[1]]))
    assert isinstance(slots, TierStoreSlots) and slots.keys == [K[0], K[1]]
    pending = await deployment.lookup(K[0], K[1])
    assert (pending.slot_ids, pending.num_pending) == ([], 2)
    with_region(region, lambda r: write_slots(r, slots.keys, slots.slot_ids))
    await deployment.release(stored_keys=slots.keys)
    hit = await deployment.lookup(K[0], K[1], K[2])
    assert hit.slot_ids == slots.slot_ids and hit.usage == 0.5
    assert read_slots(region, hit.slot_ids) == [payload(K[0]), payload(K[1])]
    tier = deployment.tier
    assert tier.load()["num_pins"] == 2.0
    await deployment.release(loaded_keys=[K[0], K[1]])
    await wait_for(lambda: tier.load()["num_pins"] == 0.0, "the pins released")
    assert tier.num_handler_errors == 0


async def test_pinned_chunks_survive_stores_until_released(deployment):
    await deployment.start_tier(deployment.kv_config(num_slots=2))
    region = await deployment.attach()
    await deployment.store(region, K[0], K[1])
    assert (await deployment.lookup(K[0])).slot_ids  # K[0] pinned
    full = await deployment.ask(TierPrepareStore(OWNER, [K[2], K[3]]))
    assert isinstance(full, TierStoreSlots) and not full.accepted
    await deployment.store(region, K[2])  # K[1] idle: it goes
    assert (await deployment.lookup(K[1])).slot_ids == []
    assert read_slots(region, (await deployment.lookup(K[0])).slot_ids) == [payload(K[0])]
    await deployment.release(loaded_keys=[K[0], K[0], K[2]])  # K[2]: never pinned, ignored
    both = await deployment.ask(TierPrepareStore(OWNER, [K[3], K[4]]))
    assert isinstance(both, TierStoreSlots) and both.accepted  # K[0] and K[2] go
    assert (await deployment.lookup(K[0])).slot_ids == []
    assert deployment.tier.num_handler_errors == 0


async def test_expired_leases_free_pins_and_unfinished_stores(deployment):
    tier = await deployment.start_tier(
        deployment.kv_config(num_slots=2), lease_s=0.3, sweep_interval_s=0.05
    )
    region = await deployment.attach()
    await deployment.store(region, K[0])
    assert (await deployment.lookup(K[0])).slot_ids
    reserved = await deployment.ask(TierPrepareStore(OWNER, [K[1]]))
    assert reserved.accepted and tier.load()["num_pins"] == 1.0
    await wait_for(lambda: tier.load()["num_pins"] == 0.0, "the pin's lease ran out")
    await wait_for(lambda: tier.load()["num_pending_stores"] == 0.0, "the store's lease ran out")
    assert tier.load()["num_pins_expired"] == 1.0
    await deployment.release(loaded_keys=[K[0]], stored_keys=[K[1]])  # late: ignored
    assert (await deployment.lookup(K[1])).slot_ids == []
    both = await deployment.ask(TierPrepareStore(OWNER, [K[2], K[3]]))  # evicts K[0]
    assert isinstance(both, TierStoreSlots) and both.accepted
    assert tier.num_handler_errors == 0


async def test_renewed_pins_and_stores_outlive_their_lease(deployment):
    """An engine core that still holds a pin and a store renews them: they stay past the lease
    (a slot under a load or a store still to be copied is never reused); unrenewed, they go."""
    tier = await deployment.start_tier(
        deployment.kv_config(num_slots=3), lease_s=0.4, sweep_interval_s=0.05
    )
    region = await deployment.attach()
    await deployment.store(region, K[0])
    assert (await deployment.lookup(K[0])).slot_ids
    assert (await deployment.ask(TierPrepareStore(OWNER, [K[1]]))).accepted
    subject = tier.subjects.tier_in(tier.actor_id)
    renew = Codec(TierRenew).encode(TierRenew(OWNER, [K[0], K[1]]))
    started = time.monotonic()
    while time.monotonic() - started < 1.2:  # three leases, renewed every 0.1 s
        await deployment.bus.publish(subject, renew)
        await asyncio.sleep(0.1)  # paces the renewals (what the engine core's link does)
    assert (tier.load()["num_pins"], tier.load()["num_pending_stores"]) == (1.0, 1.0)
    await wait_for(lambda: tier.load()["num_pins"] == 0.0, "unrenewed, the pin expires")
    assert tier.load()["num_pending_stores"] == 0.0 and tier.num_handler_errors == 0


async def test_a_different_layout_and_a_budget_below_one_slot_are_refused(deployment):
    await deployment.start_tier(deployment.kv_config(num_slots=2))
    region = await deployment.attach()
    other = await deployment.ask(TierAttach(msgspec.structs.replace(LAYOUT, num_layers=2)))
    assert isinstance(other, TierError) and "refused" in other.message
    assert await deployment.attach() == region
    small = KVTransferConfig(kv_connector="OffloadingConnector", cpu_bytes_to_use=63)
    small_tier = await deployment.start_tier(small, tier_id="kv-small")
    error = await deployment.ask(TierAttach(LAYOUT))
    assert isinstance(error, TierError), error
    assert "cpu_bytes_to_use" in error.message and "64 bytes" in error.message
    assert small_tier.region is None
    before_attach = await deployment.ask(TierLookup(OWNER, [K[0]]))
    assert isinstance(before_attach, TierError) and "TierAttach" in before_attach.message


async def test_a_restarted_tier_makes_a_new_region_and_removes_the_old(deployment):
    config = ShoalConfig.from_options(
        model="unused", namespace=deployment.namespace, cpu_bytes_to_use=4 * LAYOUT.slot_bytes
    )
    old = await deployment.start_tier(config)
    first = await deployment.attach()
    await deployment.store(first, K[0])
    assert (await deployment.lookup(K[0])).slot_ids
    await old.stop()
    Path(first.path).write_bytes(b"left by a killed tier")
    new = await deployment.start_tier(config)
    assert new.actor_id == old.actor_id == "kv-cpu"
    second = await deployment.attach()
    assert second.generation == new.incarnation != first.generation
    assert not Path(first.path).exists() and Path(second.path).exists()
    await deployment.release(loaded_keys=[K[0]], stored_keys=[K[0]])  # the old tier's
    assert (await deployment.lookup(K[0])).slot_ids == []
    assert new.num_handler_errors == 0
    await new.stop()
    assert not Path(second.path).exists()


async def test_chunks_cascade_to_the_secondary_and_promote_back(deployment):
    kv = deployment.kv_config(num_slots=4, secondary=True)
    double = await deployment.start_secondary(kv)
    old = await deployment.start_tier(kv)
    first = await deployment.attach()
    assert old.links[0].is_attached
    await deployment.store(first, K[0], K[1])
    await wait_for(lambda: old.load()["num_cascaded"] == 2.0, "the cascade")
    assert double.chunks == {K[0]: payload(K[0]), K[1]: payload(K[1])}
    assert old.load()["num_pins"] == 0.0  # the cascade's pins are back
    await old.stop()
    new = await deployment.start_tier(kv)
    second = await deployment.attach()
    reply = await deployment.lookup(K[0], K[1], K[2])
    assert len(reply.slot_ids) == 2 and reply.generation == second.generation
    assert read_slots(second, reply.slot_ids) == [payload(K[0]), payload(K[1])]
    assert (new.load()["num_promoted"], new.load()["num_pins"]) == (2.0, 2.0)
    num_asked = double.num_lookups
    again = await deployment.lookup(K[0], K[1])
    assert again.slot_ids == reply.slot_ids and double.num_lookups == num_asked
    assert new.load()["num_cascaded"] == 0.0  # promoted chunks are not cascaded back
    (cascade, promote) = double.deadlines
    assert cascade[0] == "cascade" and 0 < cascade[1] - cascade[2] <= old.lease_s / 2
    assert promote[0] == "promote" and 0 < promote[1] - promote[2] <= new.promote_budget_s


async def test_a_requests_load_tiers_limit_what_a_lookup_uses(deployment):
    """``kv_load_tiers``: a secondary is asked only if its type is listed, chunks held here
    count only with ``cpu`` listed (and then are not promoted over either)."""
    kv = deployment.kv_config(num_slots=8, secondary=True)
    double = await deployment.start_secondary(kv)
    double.chunks = {K[0]: payload(K[0]), K[1]: payload(K[1])}
    await deployment.start_tier(kv)
    region = await deployment.attach()
    assert (await deployment.lookup(K[0], K[1], tiers=["cpu"])).slot_ids == []
    assert double.num_lookups == 0  # the fs tier was not asked
    hit = await deployment.lookup(K[0], K[1], tiers=["fs"])
    assert read_slots(region, hit.slot_ids) == [payload(K[0]), payload(K[1])]
    await deployment.release(loaded_keys=[K[0], K[1]])
    assert (await deployment.lookup(K[0], K[1], tiers=["fs"])).slot_ids == []  # held here now
    assert (await deployment.lookup(K[0], K[1], tiers=["obj", "fs"])).slot_ids == []
    assert len((await deployment.lookup(K[0], K[1], tiers=["cpu"])).slot_ids) == 2
    assert len((await deployment.lookup(K[0], K[1])).slot_ids) == 2


async def test_a_dead_or_slow_secondary_never_holds_a_lookup_up(deployment):
    kv = deployment.kv_config(num_slots=4, secondary=True)
    tier = await deployment.start_tier(kv)  # no secondary running: nobody answers
    region = await deployment.attach()
    assert not tier.links[0].is_attached
    await deployment.store(region, K[0])
    assert (await deployment.lookup(K[0], K[1], timeout=ENGINE_PATIENCE_S)).slot_ids
    assert tier.load()["num_cascade_dropped"] == 1.0
    double = await deployment.start_secondary(kv)
    tier.links[0].retry_s = 0.0
    await deployment.lookup(K[5])  # the detached secondary is attached again behind it
    await wait_for(lambda: tier.links[0].is_attached, "attached again")
    await double.stop()  # dead once attached
    assert len((await deployment.lookup(K[0], K[1], timeout=ENGINE_PATIENCE_S)).slot_ids) == 1
    assert not tier.links[0].is_attached
    slow = await deployment.start_secondary(kv)
    slow.hang_lookups = True
    await deployment.lookup(K[5])
    await wait_for(lambda: tier.links[0].is_attached, "attached again")
    reply = await deployment.lookup(
        K[0], K[1], timeout=ENGINE_PATIENCE_S
    )  # within the engine's patience
    assert len(reply.slot_ids) == 1
    assert slow.num_lookups == 1 and not tier.links[0].is_attached
    tier.links[0].retry_s = 60.0
    await deployment.lookup(K[1], timeout=ENGINE_PATIENCE_S)
    assert slow.num_lookups == 1  # detached: not asked again until it is attached again
    assert tier.num_handler_errors == 0


async def test_cascades_past_the_bound_are_dropped_but_loads_go_on(deployment):
    kv = deployment.kv_config(num_slots=4, secondary=True)
    double = await deployment.start_secondary(kv)
    double.gate_cascades = True
    tier = await deployment.start_tier(kv, max_cascades_in_flight=1)
    region = await deployment.attach()
    await deployment.store(region, K[0])
    await wait_for(lambda: double.num_cascades_started == 1, "a cascade in flight")
    await deployment.store(region, K[1])
    assert tier.load()["num_cascade_dropped"] == 1.0
    hit = await deployment.lookup(K[0], K[1])
    assert read_slots(region, hit.slot_ids) == [payload(K[0]), payload(K[1])]
    double.unblocked.set()
    await wait_for(lambda: tier.load()["num_cascaded"] == 1.0, "the cascade done")
    assert list(double.chunks) == [K[0]] and double.num_cascades_started == 1
    await deployment.store(region, K[2])  # room again
    await wait_for(lambda: K[2] in double.chunks, "the next cascade")


async def test_a_slow_secondary_gets_its_stores_dropped_but_loads_go_on(deployment):
    """Backpressure: cascades slower than the high water mark put the tier under pressure and
    later stores to it are dropped (the ones let through keep measuring it); lookups and
    promotions from it go on; once it is fast again, the pressure ends and stores flow."""
    pressure = BackpressureConfig(ema_alpha=1.0, high_water_s=0.05, low_water_s=0.02,
                                  max_drop_probability=0.9)  # fmt: skip
    kv = deployment.kv_config(num_slots=8, secondary=True, backpressure=pressure)
    double = await deployment.start_secondary(kv)
    double.cascade_delay_s = 0.1
    tier = await deployment.start_tier(kv)
    tier.backpressure[double.actor_id] = StoreBackpressure(pressure, draw=lambda: 0.0)
    region = await deployment.attach()
    await deployment.store(region, K[0])
    await wait_for(lambda: tier.load()["num_cascaded"] == 1.0, "a slow cascade")
    assert tier.backpressure[double.actor_id].under_pressure
    await deployment.store(region, K[1], K[2])
    assert tier.load()["num_backpressure_dropped"] == 2.0 and K[1] not in double.chunks
    hit = await deployment.lookup(K[0], K[1], K[2])  # still held here: loads are not dropped
    assert read_slots(region, hit.slot_ids) == [payload(k) for k in (K[0], K[1], K[2])]
    await deployment.release(loaded_keys=[K[0], K[1], K[2]])
    double.cascade_delay_s = 0.0
    tier.backpressure[double.actor_id]._draw = lambda: 0.95  # the next store goes through
    await deployment.store(region, K[3])
    await wait_for(lambda: K[3] in double.chunks, "a fast cascade")
    await wait_for(lambda: not tier.backpressure[double.actor_id].under_pressure, "relief")
    await deployment.store(region, K[4])
    await wait_for(lambda: K[4] in double.chunks, "stores flowing again")
    assert tier.load()["num_backpressure_dropped"] == 2.0


async def test_a_cascade_left_unanswered_keeps_its_pins_until_its_deadline(deployment):
    kv = deployment.kv_config(num_slots=4, secondary=True)
    double = await deployment.start_secondary(kv)
    double.gate_cascades = True  # it may still read the slots after the tier stops waiting
    tier = await deployment.start_tier(  # the cascade's deadline: lease_s / 2, 1.5 s in
        kv, lease_s=3.0, sweep_interval_s=0.05, secondary_timeout_s=0.1, cascade_timeout_s=0.1
    )
    region = await deployment.attach()
    await deployment.store(region, K[0])
    await wait_for(lambda: not tier.links[0].is_attached, "the cascade timed out")
    assert tier.load()["num_pins"] == 1.0  # it may still read the slot until the deadline
    assert tier.links[0].num_in_flight == 1  # and it still counts
    await wait_for(lambda: tier.load()["num_pins"] == 0.0, "handed back past the deadline")
    assert tier.links[0].num_in_flight == 0 and tier.load()["num_cascade_failures"] == 1.0
    assert tier.load()["num_pins_expired"] == 0.0  # not by the lease (3 s)


async def test_only_a_wait_of_the_links_own_length_detaches_it(deployment):
    """A lookup whose budget is nearly spent (it waited for another's promotion) asks a
    secondary with what is left: that running out says nothing about the secondary."""
    kv = deployment.kv_config(num_slots=4, secondary=True)
    double = await deployment.start_secondary(kv)
    double.hang_lookups = True
    tier = await deployment.start_tier(kv, secondary_timeout_s=0.2)
    await deployment.attach()
    link = tier.links[0]
    assert await link.held([K[0]], timeout_s=0.05) == 0 and link.is_attached
    assert await link.held([K[0]]) == 0 and not link.is_attached  # its own 0.2 s: detached


async def test_run_actor_builds_it_from_the_deployments_json(deployment):
    """``bus.runtime.run_actor`` builds it from JSON keywords (the deployment's config, a
    directory)."""
    config = ShoalConfig.from_options(
        model="unused", namespace=deployment.namespace, cpu_bytes_to_use=LAYOUT.slot_bytes
    )
    kwargs = {"config": msgspec.to_builtins(config), "region_directory": str(deployment.directory)}
    tier = build_actor(CpuTierActor, deployment.bus, kwargs)
    assert isinstance(tier, CpuTierActor)
    assert (tier.actor_id, tier.subjects.namespace) == ("kv-cpu", deployment.namespace)
    await tier.start()
    deployment.actors.append(tier)
    deployment.tier = tier
    assert Path((await deployment.attach()).path).parent == deployment.directory


async def test_a_promotion_left_unanswered_keeps_its_slots_until_its_deadline(deployment):
    kv = deployment.kv_config(num_slots=4, secondary=True)
    double = await deployment.start_secondary(kv)
    double.chunks[K[1]] = payload(K[1])
    double.hang_promotes = True  # it may still write the slots after the tier stops waiting
    tier = await deployment.start_tier(
        kv, lease_s=3.0, sweep_interval_s=0.05, secondary_timeout_s=0.1, cascade_timeout_s=0.1
    )
    region = await deployment.attach()
    await deployment.store(region, K[0])
    reply = await deployment.lookup(K[0], K[1], timeout=ENGINE_PATIENCE_S)
    assert len(reply.slot_ids) == 1 and reply.usage == 0.5  # K[1]'s slot is still reserved
    assert tier.load()["num_pending_stores"] == 1.0 and tier.links[0].num_in_flight == 1
    await wait_for(lambda: tier.load()["num_pending_stores"] == 0.0, "freed past the deadline")
    assert tier.links[0].num_in_flight == 0 and tier.load()["usage"] == 0.25
    assert tier.load()["num_stores_expired"] == 0.0  # not by the lease (3 s)
    assert tier.load()["num_promote_failures"] == 1.0


async def test_other_generations_are_ignored_and_renewals_counted(deployment):
    """A release or renewal naming an earlier incarnation's region must not unpin, settle or
    keep alive what the same owner holds in this one (naming none is the old protocol); a
    renewal keeps as many pins of a key as it names it."""
    tier = await deployment.start_tier(
        deployment.kv_config(num_slots=4), lease_s=0.4, sweep_interval_s=0.05
    )
    region = await deployment.attach()
    await deployment.store(region, K[0])
    assert (await deployment.lookup(K[0])).slot_ids
    slots = await deployment.ask(TierPrepareStore(OWNER, [K[1]]))
    stale = await deployment.ask(
        TierRelease(OWNER, loaded_keys=[K[0]], stored_keys=[K[1]], generation="earlier")
    )
    assert stale == TierJobDone() and tier.load()["num_pins"] == 1.0
    assert (await deployment.lookup(K[1])).num_pending == 1
    current = TierRelease(OWNER, [K[0]], slots.keys, generation=region.generation)
    assert await deployment.ask(current) == TierJobDone(done_keys=[K[1]])
    assert tier.load()["num_pins"] == 0.0
    for _ in range(2):  # two pins; the owner knows of one (it gave up on the other lookup)
        assert (await deployment.lookup(K[1])).slot_ids == slots.slot_ids
    await deployment.renew_for(0.8, TierRenew(OWNER, [K[1]], region.generation))
    assert tier.load()["num_pins"] == 1.0 and tier.load()["num_pins_expired"] == 1.0
    await deployment.renew_for(0.8, TierRenew(OWNER, [K[1]], "earlier"))
    assert tier.load()["num_pins"] == 0.0 and tier.load()["num_pins_expired"] == 2.0
    assert tier.load()["num_stale_ignored"] >= 2.0 and tier.num_handler_errors == 0


async def test_one_lookup_waits_on_all_secondaries_within_one_budget(deployment):
    """With several slow secondaries, a lookup's waits together stay within promote_budget_s
    (half the engine core's kv_lookup_timeout_s): a secondary past it is not asked."""
    kv = deployment.kv_config(num_slots=4, secondary=True, num_secondaries=3)
    doubles = [await deployment.start_secondary(kv, i) for i in range(3)]
    for double in doubles:
        double.hang_lookups = True
    tier = await deployment.start_tier(kv, secondary_timeout_s=0.2)
    await deployment.attach()
    assert all(link.is_attached for link in tier.links) and tier.promote_budget_s == 0.4
    started = time.monotonic()
    assert (await deployment.lookup(K[0], timeout=ENGINE_PATIENCE_S)).slot_ids == []
    assert time.monotonic() - started < 0.4 + 0.3
    assert [d.num_lookups for d in doubles] == [1, 1, 0]


# -- a lookup that meets a promotion in flight (vLLM: RETRY, handled in the tier) ----------------


async def test_a_lookup_meeting_a_promotion_waits_for_it_and_goes_on_with_the_rest(deployment):
    """The chunks two lookups share are promoted once; the second lookup pins them for its own
    owner (one release leaves the other's pins) and promotes the rest of its prefix itself."""
    kv = deployment.kv_config(num_slots=4, secondary=True)
    double = await deployment.start_secondary(kv)
    double.chunks = {key: payload(key) for key in K[:4]}
    double.hang_promotes = True
    tier = await deployment.start_tier(kv)
    region = await deployment.attach()
    first = asyncio.create_task(deployment.lookup(K[0], K[1]))
    await wait_for(lambda: len(double.promotes) == 1, "the first lookup's promotion in flight")
    second = asyncio.create_task(deployment.lookup(*K[:4], owner=OTHER))
    await wait_for(lambda: tier.load()["num_promotion_waits"] == 1.0, "the second one waits")
    double.promotes_unblocked.set()
    mine, theirs = await first, await second
    assert double.promotes == [[K[0], K[1]], [K[2], K[3]]]
    assert theirs.slot_ids[:2] == mine.slot_ids and theirs.num_pending == 0
    assert read_slots(region, theirs.slot_ids) == [payload(key) for key in K[:4]]
    assert (tier.load()["num_promoted"], tier.load()["num_pins"]) == (4.0, 6.0)
    await deployment.release(loaded_keys=[K[0], K[1]])
    await wait_for(lambda: tier.load()["num_pins"] == 4.0, "the first lookup's pins released")
    full = await deployment.ask(TierPrepareStore(OWNER, [K[5]]))
    assert isinstance(full, TierStoreSlots) and not full.accepted  # the other's pins hold
    await deployment.release(OTHER, loaded_keys=K[:4])
    await wait_for(lambda: tier.load()["num_pins"] == 0.0, "the second lookup's pins released")
    assert (await deployment.ask(TierPrepareStore(OWNER, [K[5]]))).accepted
    assert len(tier.promotion_waits) == 0 and tier.books.num_promotions_in_flight == 0
    assert tier.num_handler_errors == 0


async def test_lookups_that_both_asked_the_secondary_first_promote_the_chunks_once(deployment):
    kv = deployment.kv_config(num_slots=4, secondary=True)
    double = await deployment.start_secondary(kv)
    double.chunks = {key: payload(key) for key in K[:3]}
    double.hang_lookups = double.hang_promotes = True
    tier = await deployment.start_tier(kv)
    region = await deployment.attach()
    first = asyncio.create_task(deployment.lookup(*K[:3]))
    second = asyncio.create_task(deployment.lookup(*K[:3], owner=OTHER))
    await wait_for(lambda: double.num_lookups == 2, "both lookups ask the secondary")
    double.unblocked.set()
    await wait_for(lambda: tier.load()["num_promotion_waits"] == 1.0, "one waits for the other")
    double.promotes_unblocked.set()
    mine, theirs = await first, await second
    assert double.promotes == [K[:3]] and mine.slot_ids == theirs.slot_ids
    assert read_slots(region, mine.slot_ids) == [payload(key) for key in K[:3]]
    assert (tier.load()["num_promoted"], tier.load()["num_pins"]) == (3.0, 6.0)
    assert len(tier.promotion_waits) == 0 and tier.num_handler_errors == 0


async def test_a_waiter_on_a_promotion_that_fails_partly_gets_the_run_that_succeeded(deployment):
    kv = deployment.kv_config(num_slots=4, secondary=True)
    double = await deployment.start_secondary(kv)
    double.chunks = {key: payload(key) for key in K[:3]}
    double.hang_promotes = True
    tier = await deployment.start_tier(kv)
    region = await deployment.attach()
    first = asyncio.create_task(deployment.lookup(*K[:3]))
    await wait_for(lambda: len(double.promotes) == 1, "the first lookup's promotion in flight")
    second = asyncio.create_task(deployment.lookup(*K[:3], owner=OTHER))
    await wait_for(lambda: tier.load()["num_promotion_waits"] == 1.0, "the second one waits")
    del double.chunks[K[1]]  # lost before it is read: only K[0] comes
    double.promotes_unblocked.set()
    mine, theirs = await first, await second
    assert mine.slot_ids == theirs.slot_ids and len(mine.slot_ids) == 1
    assert read_slots(region, theirs.slot_ids) == [payload(K[0])]
    assert (theirs.num_pending, theirs.usage) == (0, 0.25)
    assert (tier.load()["num_promoted"], tier.load()["num_promote_failures"]) == (1.0, 2.0)
    assert (tier.load()["num_pins"], tier.load()["num_pending_stores"]) == (2.0, 0.0)
    assert double.promotes == [K[:3]]  # asked again, the secondary had nothing more
    assert len(tier.promotion_waits) == 0 and tier.num_handler_errors == 0


async def test_a_waiter_on_a_promotion_that_times_out_answers_within_its_budget(deployment):
    """The promotion's slots stay reserved until their lease ends (the secondary may still
    write them): the waiter, and every lookup after it, reports them pending and waits no more."""
    kv = deployment.kv_config(num_slots=4, secondary=True)
    double = await deployment.start_secondary(kv)
    double.chunks = {key: payload(key) for key in K[:2]}
    double.hang_promotes = True
    tier = await deployment.start_tier(
        kv, lease_s=0.8, sweep_interval_s=0.05, secondary_timeout_s=0.1, cascade_timeout_s=0.1
    )
    await deployment.attach()
    first = asyncio.create_task(deployment.lookup(K[0], K[1]))
    await wait_for(lambda: len(double.promotes) == 1, "the first lookup's promotion in flight")
    started = time.monotonic()
    waiter = await deployment.lookup(K[0], K[1], owner=OTHER)
    assert time.monotonic() - started < tier.promote_budget_s + 0.5
    assert (waiter.slot_ids, waiter.num_pending) == ([], 2)
    assert ((await first).slot_ids, tier.load()["num_promotion_waits"]) == ([], 1.0)
    later = await deployment.lookup(K[0], K[1], owner=OTHER)
    assert (later.slot_ids, later.num_pending, later.usage) == ([], 2, 0.5)
    assert tier.load()["num_promotion_waits"] == 1.0  # abandoned: nobody waits for it
    assert len(tier.promotion_waits) == 0 and tier.books.num_promotions_in_flight == 0
    await wait_for(lambda: tier.load()["num_pending_stores"] == 0.0, "the reservation's lease")
    assert tier.load()["usage"] == 0.0 and tier.num_handler_errors == 0


async def test_a_waiter_stops_at_its_own_budget_while_the_promotion_goes_on(deployment):
    kv = deployment.kv_config(num_slots=4, secondary=True)
    double = await deployment.start_secondary(kv)
    double.chunks = {key: payload(key) for key in K[:2]}
    double.hang_promotes = True
    tier = await deployment.start_tier(kv, secondary_timeout_s=1.0)  # a 2 s budget
    region = await deployment.attach()
    first = asyncio.create_task(deployment.lookup(K[0], K[1]))
    await wait_for(lambda: len(double.promotes) == 1, "the first lookup's promotion in flight")
    tier.promote_budget_s = 0.2  # the next lookup's budget ends long before the promotion's
    started = time.monotonic()
    waiter = await deployment.lookup(K[0], K[1], owner=OTHER)
    assert time.monotonic() - started < 1.2  # not the promotion's 2 s
    assert (waiter.slot_ids, waiter.num_pending) == ([], 2)
    assert tier.load()["num_promotion_waits"] == 1.0 and not first.done()
    double.promotes_unblocked.set()
    assert read_slots(region, (await first).slot_ids) == [payload(K[0]), payload(K[1])]
    assert tier.load()["num_pins"] == 2.0 and len(tier.promotion_waits) == 0


async def test_chunks_an_engine_core_is_still_storing_are_reported_pending_not_waited_for(
    deployment,
):
    """Its copy lands with that engine core's next step, whenever that is: not waited for."""
    kv = deployment.kv_config(num_slots=4, secondary=True)
    double = await deployment.start_secondary(kv)
    double.chunks = {key: payload(key) for key in K[:3]}
    tier = await deployment.start_tier(kv)
    region = await deployment.attach()
    await deployment.store(region, K[0])
    pending = await deployment.ask(TierPrepareStore(OTHER, [K[1]]))
    assert isinstance(pending, TierStoreSlots) and pending.keys == [K[1]]
    reply = await deployment.lookup(*K[:3])
    assert (len(reply.slot_ids), reply.num_pending) == (1, 1)
    assert double.promotes == [] and tier.load()["num_promotion_waits"] == 0.0
