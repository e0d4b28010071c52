"""The peer-to-peer tier actor: a secondary tier behind a CPU tier that finds chunks in the CPU
tiers of the other hosts and pulls them over the bus (``bus.messages.p2p``).

It keeps no chunks of its own (the CPU tier cascades nothing to it) and plays two parts:

- **Asking** (its own CPU tier's ``TierLookup`` → ``TierHeld``): one round for the whole prefix,
  a ``PeerLookup`` to every peer at once; the round ends when every peer that answered lately
  has answered (or one holds every key), at the latest after ``peer_lookup_timeout_s``. The
  longest answer is kept as a planned pull (the other peers' sessions are ended at once) and
  the CPU tier's ``TierPromote`` that follows pulls it (``tiers.p2p_pull``) into the reserved
  slots: done is the leading run that arrived whole and intact before the deadline. A peer
  that dies mid-transfer leaves the rest a miss (recomputed), never a wrong byte.
- **Serving** (a peer's ``PeerLookup``): the leading keys its own CPU tier holds are pinned
  there for the session (``TierLookup`` as owner ``<actor id>.<incarnation>`` asking for ``cpu``
  only, so a peer's lookup never promotes or asks peers in turn), and each ``PeerRead`` is
  answered with a slot's bytes in the part format (digest included) read from the mapped
  region. ``PeerDone`` (or ``session_ttl_s``) hands the pins back. The region is this host's
  CPU tier's (``TierAttach(create=False)``: a host whose CPU tier has none, or another layout,
  holds nothing).

Until its CPU tier attaches it (at start, and again after a restart of this actor) it refuses
lookups and promotions with a ``TierError``: the CPU tier's link then attaches it again.

Bulk bytes ride on NATS (chunked by the bus past its payload limit, pulled by the receiver)
rather than a direct socket: the bus is the one path every host of a deployment is known to
reach, with its authorisation, and ``shoal bench offload`` measures what it costs.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from shoal.bus.actor import Actor, Inbox, call
from shoal.bus.base import Bus, BusError, Msg
from shoal.bus.codec import Codec, DecodeError, encode
from shoal.bus.messages.config import P2PTierConfig
from shoal.bus.messages.offload import (
    KVLayout,
    RegionRef,
    SecondaryAttached,
    SecondaryInbound,
    TierAttach,
    TierAttached,
    TierCascade,
    TierError,
    TierHeld,
    TierJobDone,
    TierLookup,
    TierLookupReply,
    TierPromote,
    TierRelease,
    TierReply,
)
from shoal.bus.messages.p2p import (
    PeerBroadcast,
    PeerDone,
    PeerHeld,
    PeerHello,
    PeerInbound,
    PeerLookup,
    PeerRead,
)
from shoal.tiers.chunk_format import CorruptChunk, pack_head
from shoal.tiers.keys import OffloadKey
from shoal.tiers.mapped_regions import MappedRegions
from shoal.tiers.p2p_pull import PullJob, pull_run
from shoal.tiers.p2p_sessions import (
    PeerDirectory,
    PlannedPulls,
    ServedSessions,
    best_answer,
)
from shoal.tiers.secondary_actor import is_past

log = logging.getLogger(__name__)

_SECONDARY: Codec[SecondaryInbound] = Codec(SecondaryInbound)
_BROADCAST: Codec[PeerBroadcast] = Codec(PeerBroadcast)
_HELD: Codec[PeerHeld] = Codec(PeerHeld)
_PEER: Codec[PeerInbound] = Codec(PeerInbound)
_ATTACHED: Codec[TierAttached | TierError] = Codec(TierAttached | TierError)
_LOOKED_UP: Codec[TierLookupReply | TierError] = Codec(TierLookupReply | TierError)


@dataclass(slots=True)
class P2PTierCounters:
    """Sent with every heartbeat (``load``); the gateway's tiering metrics read the
    ``num_chunks_loaded`` / ``num_load_failures`` / ``num_chunks_corrupt`` figures."""

    num_rounds: int = 0  # lookup rounds asked of the peers
    num_round_hits: int = 0  # rounds that found a peer holding some of the prefix
    num_chunks_found: int = 0  # chunks the rounds found
    num_chunks_loaded: int = 0  # chunks pulled into this host's region
    num_load_failures: int = 0  # chunks not pulled (the peer gone, late, no plan)
    num_chunks_corrupt: int = 0  # chunks that arrived damaged
    num_bytes_pulled: int = 0
    pull_time_s: float = 0.0  # spent in promotions' pulls
    num_sessions_served: int = 0  # peers' rounds this host answered holding chunks
    num_chunks_served: int = 0  # chunk reads answered
    num_sessions_expired: int = 0  # served sessions their peer never ended


class P2PTierActor(Actor):
    """A peer-to-peer tier (``P2PTierConfig``) of the CPU tier ``cpu_tier_id``, reached on
    ``subjects.tier_in(actor_id)``; its peers are every other p2p tier of the namespace."""

    kind = "tier"

    def __init__(
        self,
        bus: Bus,
        actor_id: str,
        *,
        tier_config: P2PTierConfig,
        cpu_tier_id: str,
        namespace: str = "shoal",
        session_ttl_s: float = 10.0,  # a served session not ended by then is handed back
        plan_ttl_s: float = 5.0,  # a round's answer waits this long for its promotion
        cpu_tier_timeout_s: float = 0.5,  # this host's CPU tier, asked while serving a peer
        keep_regions: int = 2,
        heartbeat_interval_s: float = 1.0,
        drain_timeout_s: float = 5.0,
    ) -> None:
        super().__init__(
            bus,
            actor_id,
            namespace=namespace,
            heartbeat_interval_s=heartbeat_interval_s,
            drain_timeout_s=drain_timeout_s,
        )
        self.tier_config = tier_config
        self.cpu_tier_id = cpu_tier_id
        self.cpu_tier_timeout_s = cpu_tier_timeout_s
        self.counters = P2PTierCounters()
        self.layout: KVLayout | None = None  # the layout this host's CPU tier attached with
        self.served = ServedSessions(session_ttl_s)
        self.plans = PlannedPulls(plan_ttl_s)
        self.peers = PeerDirectory()
        self.regions = MappedRegions(keep_regions)
        self._local_region: RegionRef | None = None  # this host's CPU tier's (serving side)
        self._rounds: dict[str, asyncio.Queue[PeerHeld]] = {}
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def owner(self) -> str:
        """Who the pins taken in this host's CPU tier for peers belong to."""
        return f"{self.actor_id}.{self.incarnation}"

    def inboxes(self) -> Sequence[Inbox]:
        subjects = self.subjects
        return [
            Inbox(subjects.tier_in(self.actor_id), self.on_request, _SECONDARY),
            Inbox(subjects.tier_peers(), self.on_peer_broadcast, _BROADCAST),
            Inbox(subjects.tier_peer_reads(self.actor_id), self.on_peer_request, _PEER),
            Inbox(subjects.tier_peer_answers(self.actor_id), self.on_peer_held, _HELD),
        ]

    async def on_start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_loop())

    async def start(self) -> None:
        await super().start()  # subscribed: the answers to the hello reach it
        try:
            await self.bus.publish(self.subjects.tier_peers(), encode(PeerHello(self.actor_id)))
        except BusError as exc:  # the peers learn of it from its first round instead
            log.warning("%r: hello not sent: %r", self, exc)

    async def on_stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        for served in self.served.expire(float("inf")):
            await self._unpin(served.keys, served.region)
        self.regions.close()

    def load(self) -> dict[str, float]:
        figures = {name: float(value) for name, value in asdict(self.counters).items()}
        figures["num_sessions_open"] = float(len(self.served))
        figures["num_planned_pulls"] = float(len(self.plans))
        figures["num_peers"] = float(len(self.peers.expected()))
        return figures

    # -- this host's CPU tier ---------------------------------------------------------------

    async def on_request(self, request: SecondaryInbound, msg: Msg) -> TierReply:
        match request:
            case TierAttach(layout=layout):
                self.layout = layout
                return SecondaryAttached(0, 0.0)
        if self.layout is None:  # restarted: the CPU tier's link attaches it again
            return TierError(f"tier {self.actor_id} is not attached: send TierAttach first")
        match request:
            case TierLookup(keys=keys):
                return TierHeld(await self._ask_peers(keys))
            case TierPromote():
                return await self._promote(request)
            case TierCascade(keys=keys):
                return TierJobDone(failed_keys=list(keys))  # it keeps no chunks
        return TierError(f"tier {self.actor_id} does not serve {type(request).__name__}")

    async def _ask_peers(self, keys: list[OffloadKey]) -> int:
        """One round: how many leading ``keys`` the best peer pinned (its pull planned)."""
        if self.layout is None or not keys:
            return 0
        session = secrets.token_hex(8)
        answers = self._rounds[session] = asyncio.Queue()
        self.counters.num_rounds += 1
        expected = self.peers.expected()
        lookup = PeerLookup(self.actor_id, session, self.layout, keys)
        try:
            await self.bus.publish(self.subjects.tier_peers(), encode(lookup))
            heard = await self._gather(answers, expected, len(keys))
        except BusError as exc:
            log.warning("%r: lookup round not sent: %r", self, exc)
            heard = []
        finally:
            del self._rounds[session]
        self.peers.missed(expected - {peer for peer, _, _ in heard})
        best = best_answer(heard)
        for peer, _, num in heard:
            if num and (best is None or peer != best[0]):
                await self._end_session(peer, session)
        if best is None:
            return 0
        replaced = self.plans.add(best[0], session, keys[: best[2]], time.monotonic())
        if replaced is not None:
            await self._end_session(replaced.peer, replaced.session)
        self.counters.num_round_hits += 1
        self.counters.num_chunks_found += best[2]
        return best[2]

    async def _gather(
        self, answers: asyncio.Queue[PeerHeld], expected: frozenset[str], num_keys: int
    ) -> list[tuple[str, str, int]]:
        """The answers of a round, in arrival order, until every expected peer answered (none
        expected: nobody is known yet, so the round waits), one holds every key, or
        ``peer_lookup_timeout_s`` passed."""
        heard: list[tuple[str, str, int]] = []
        end = time.monotonic() + self.tier_config.peer_lookup_timeout_s
        while (left := end - time.monotonic()) > 0:
            try:
                held = await asyncio.wait_for(answers.get(), left)
            except TimeoutError:
                break
            heard.append((held.peer, held.session, max(0, min(held.num_leading, num_keys))))
            if held.num_leading >= num_keys:
                break
            if expected and expected <= {peer for peer, _, _ in heard}:
                break
        return heard

    async def on_peer_held(self, held: PeerHeld, msg: Msg) -> None:
        self.peers.heard(held.peer)
        if not held.session:  # an answer to this tier's hello
            return
        answers = self._rounds.get(held.session)
        if answers is not None:
            answers.put_nowait(held)
        elif held.num_leading > 0:  # a late answer: its pins are nobody's
            await self._end_session(held.peer, held.session)

    async def _promote(self, job: TierPromote) -> TierReply:
        if len(job.keys) != len(job.slot_ids):
            return TierError("a promote needs one slot id per key")
        plan = self.plans.take(job.keys, time.monotonic())
        if plan is None or is_past(job.deadline) or job.region.layout != self.layout:
            self.counters.num_load_failures += len(job.keys)
            return TierJobDone(failed_keys=list(job.keys))
        started = time.monotonic()
        try:
            errors = await self._pull(plan.peer, plan.session, job)
        finally:
            await self._end_session(plan.peer, plan.session)
        self.counters.pull_time_s += time.monotonic() - started
        num_done = next((i for i, e in enumerate(errors) if e is not None), len(errors))
        corrupt = sum(isinstance(e, CorruptChunk) for e in errors)
        self.counters.num_chunks_loaded += num_done
        self.counters.num_chunks_corrupt += corrupt
        self.counters.num_load_failures += len(job.keys) - num_done - corrupt
        self.counters.num_bytes_pulled += num_done * job.region.layout.slot_bytes
        if num_done < len(job.keys):
            log.info("%r: %d of %d chunks pulled from %s: %s", self, num_done, len(job.keys),
                     plan.peer, errors[num_done])  # fmt: skip
        return TierJobDone(list(job.keys[:num_done]), list(job.keys[num_done:]))

    async def _pull(self, peer: str, session: str, job: TierPromote) -> list[Exception | None]:
        try:
            with self.regions.use(job.region) as region:
                pull = PullJob(
                    self.subjects.tier_peer_reads(peer),
                    session,
                    region,
                    job.keys,
                    job.slot_ids,
                    job.deadline,
                )
                return await pull_run(
                    self.bus,
                    pull,
                    window=self.tier_config.transfer_window,
                    read_timeout_s=self.tier_config.read_timeout_s,
                )
        except OSError as exc:
            log.warning("%r: region %s not mapped: %s", self, job.region.path, exc)
            return [exc] * len(job.keys)

    async def _end_session(self, peer: str, session: str) -> None:
        try:
            await self.bus.publish(self.subjects.tier_peer_reads(peer), encode(PeerDone(session)))
        except BusError as exc:  # the peer's session ends at its time to live
            log.debug("%r: session end not sent to %s: %r", self, peer, exc)

    # -- peers ------------------------------------------------------------------------------

    async def on_peer_broadcast(self, broadcast: PeerBroadcast, msg: Msg) -> None:
        match broadcast:
            case PeerHello(peer=peer) if peer != self.actor_id:
                self.peers.heard(peer)
                await self._answer(peer, PeerHeld(self.actor_id, "", 0))
            case PeerLookup() if broadcast.requester != self.actor_id:
                await self._serve_lookup(broadcast)

    async def _serve_lookup(self, lookup: PeerLookup) -> None:
        self.peers.heard(lookup.requester)
        num = await self._pin_for_peer(lookup)
        sent = await self._answer(lookup.requester, PeerHeld(self.actor_id, lookup.session, num))
        if num and not sent:
            await self._end_served(lookup.session)

    async def _answer(self, peer: str, held: PeerHeld) -> bool:
        try:
            await self.bus.publish(self.subjects.tier_peer_answers(peer), encode(held))
        except BusError as exc:
            log.debug("%r: answer to %s not sent: %r", self, peer, exc)
            return False
        return True

    async def _pin_for_peer(self, lookup: PeerLookup) -> int:
        """Pin in this host's CPU tier the leading keys it holds for the peer's session."""
        region = await self._cpu_region(lookup.layout) if lookup.keys else None
        if region is None:
            return 0
        request = TierLookup(self.owner, list(lookup.keys), ["cpu"])
        reply = await self._ask_cpu_tier(request, _LOOKED_UP)
        if not isinstance(reply, TierLookupReply):
            return 0
        pinned = list(lookup.keys[: len(reply.slot_ids)])
        if reply.generation != region.generation:  # the CPU tier restarted: map its new region
            self._local_region = None
            await self._unpin(pinned, None, reply.generation)
            return 0
        if pinned:
            now = time.monotonic()
            self.served.add(lookup.session, lookup.requester, region, pinned, reply.slot_ids, now)
            self.counters.num_sessions_served += 1
        return len(pinned)

    async def _cpu_region(self, layout: KVLayout) -> RegionRef | None:
        """This host's CPU tier's region if it holds ``layout`` (it makes none for a peer)."""
        region = self._local_region
        if region is None or region.layout != layout:
            reply = await self._ask_cpu_tier(TierAttach(layout, create=False), _ATTACHED)
            if not isinstance(reply, TierAttached):
                return None
            region = self._local_region = reply.region
        return region

    async def _ask_cpu_tier(self, request: object, codec: Codec[Any]) -> object | None:
        subject = self.subjects.tier_in(self.cpu_tier_id)
        try:
            return await call(self.bus, subject, request, codec, timeout=self.cpu_tier_timeout_s)
        except (BusError, DecodeError) as exc:
            log.warning("%r: CPU tier %s: %r", self, self.cpu_tier_id, exc)
            return None

    async def on_peer_request(self, request: PeerInbound, msg: Msg) -> bytes | None:
        match request:
            case PeerRead(session=session, index=index):
                return await self._serve_read(session, index)
            case PeerDone(session=session):
                await self._end_served(session)
        return None

    async def _serve_read(self, session: str, index: int) -> bytes:
        found = self.served.chunk_of(session, index, time.monotonic())
        if found is None:
            raise LookupError(f"session {session} has no chunk {index} (ended or expired)")
        region_ref, slot_id, key = found
        with self.regions.use(region_ref) as region:
            part = await asyncio.to_thread(_part_of, region.slot(slot_id), key)
        self.counters.num_chunks_served += 1
        return part

    async def _end_served(self, session: str) -> None:
        served = self.served.end(session)
        if served is not None:
            await self._unpin(served.keys, served.region)

    async def _unpin(
        self, keys: list[OffloadKey], region: RegionRef | None, generation: str = ""
    ) -> None:
        generation = generation or (region.generation if region is not None else "")
        release = TierRelease(self.owner, loaded_keys=keys, generation=generation)
        try:
            await self.bus.publish(self.subjects.tier_in(self.cpu_tier_id), encode(release))
        except BusError as exc:  # the CPU tier's lease hands them back
            log.warning("%r: pins not released: %r", self, exc)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for served in self.served.expire(now):
                self.counters.num_sessions_expired += 1
                await self._unpin(served.keys, served.region)
            for plan in self.plans.expire(now):
                await self._end_session(plan.peer, plan.session)


def _part_of(slot: memoryview, key: OffloadKey) -> bytes:
    with slot:
        return pack_head(key, slot) + bytes(slot)
