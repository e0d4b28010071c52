"""The peer-to-peer tier actor: a secondary tier behind a CPU tier that finds chunks in the CPU
tiers of the other hosts and pulls them (``bus.messages.p2p``).

It keeps no chunks of its own (the CPU tier cascades nothing to it) and plays two parts:

- **Asking** (its own CPU tier's ``TierLookup`` → ``TierHeld``): one round for the whole prefix,
  a ``PeerLookup`` to every peer at once; the round ends when every peer heard from has
  answered (or one holds every key), at the latest after ``peer_lookup_timeout_s``; with no
  peer heard from it is a miss at once. P2p tiers greet each other (``PeerHello``) at start and
  every ``hello_interval_s``; a peer that misses a round is not waited for until heard again.
  The longest answer is kept as a planned pull (every other peer's session is ended, late
  answers too) and the CPU tier's ``TierPromote`` that follows pulls it (``tiers.p2p.pull``:
  the peer's direct stream, else the bus) into the reserved slots, stopping a little before
  the promotion's deadline so the answer reaches the CPU tier in time: done is the leading run
  that arrived whole and intact. A peer that dies or stalls mid-transfer leaves the rest a
  miss (recomputed), never a wrong byte.
- **Serving** (a peer's ``PeerLookup``, ``PeerRead``, ``PeerDone`` and streams):
  ``tiers.p2p.serving``.

Until its CPU tier attaches it (at start, and again after a restart of this actor) it refuses
lookups and promotions with a ``TierError``: the CPU tier's link then attaches it again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass

from shoal.bus.base import Bus
from shoal.bus.codec import Codec, encode
from shoal.bus.errors import BusError
from shoal.bus.messages.offload import (
    KVLayout,
    SecondaryAttached,
    SecondaryInbound,
    TierAttach,
    TierCascade,
    TierError,
    TierHeld,
    TierJobDone,
    TierLookup,
    TierPromote,
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
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import Actor, Inbox
from shoal.bus.transport.data_address import data_address
from shoal.config.deployment import P2PTierConfig
from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.books.p2p_sessions import PeerDirectory, PlannedPull, PlannedPulls, best_answer
from shoal.tiers.cpu.mapped_regions import MappedRegions
from shoal.tiers.p2p.channel import ChannelServer
from shoal.tiers.p2p.pull import pull_chunks
from shoal.tiers.p2p.serving import PeerServing
from shoal.tiers.secondary.chunk_format import CorruptChunk

log = logging.getLogger(__name__)

_SECONDARY: Codec[SecondaryInbound] = Codec(SecondaryInbound)
_BROADCAST: Codec[PeerBroadcast] = Codec(PeerBroadcast)
_HELD: Codec[PeerHeld] = Codec(PeerHeld)
_PEER: Codec[PeerInbound] = Codec(PeerInbound)


@dataclass(slots=True)
class P2PTierCounters:
    """What the asking side did, sent with every heartbeat (``load``, with the serving side's);
    the gateway's tiering metrics read ``num_chunks_loaded``, ``num_load_failures`` and
    ``num_chunks_corrupt``."""

    num_rounds: int = 0  # lookup rounds asked of the peers
    num_round_hits: int = 0  # rounds that found a peer holding some of the prefix
    num_chunks_found: int = 0  # chunks the rounds found
    num_chunks_loaded: int = 0  # chunks pulled into this host's region
    num_load_failures: int = 0  # chunks not pulled (the peer gone, late, no plan)
    num_chunks_corrupt: int = 0  # chunks that arrived damaged
    num_chunks_streamed: int = 0  # of those pulled, over a direct stream
    num_bytes_pulled: int = 0
    pull_time_s: float = 0.0  # spent in promotions' pulls


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
        hello_interval_s: float = 5.0,
        sweep_interval_s: float = 1.0,  # expiries and renewals
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
        self.hello_interval_s = hello_interval_s
        self.sweep_interval_s = sweep_interval_s
        self.counters = P2PTierCounters()
        self.layout: KVLayout | None = None  # the layout this host's CPU tier attached with
        self.plans = PlannedPulls(plan_ttl_s)
        self.peers = PeerDirectory()
        self.regions = MappedRegions(keep_regions)
        self.serving = PeerServing(
            bus,
            self.subjects,
            owner=self.owner,
            cpu_tier_id=cpu_tier_id,
            regions=self.regions,
            session_ttl_s=session_ttl_s,
            cpu_tier_timeout_s=cpu_tier_timeout_s,
        )
        self.channel = ChannelServer(self.serving) if tier_config.direct_transfer else None
        self._rounds: dict[str, asyncio.Queue[PeerHeld]] = {}
        self._tasks: list[asyncio.Task[None]] = []

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
        if self.channel is not None:
            config = self.tier_config
            await self.channel.start(*data_address(config.data_host), config.data_port)

    async def start(self) -> None:
        await super().start()  # subscribed: the answers to the hello reach it
        await self._hello()
        self._tasks = [
            asyncio.create_task(self._every(self.sweep_interval_s, self._sweep)),
            asyncio.create_task(self._every(self.hello_interval_s, self._hello)),
        ]

    async def on_stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.channel is not None:
            await self.channel.stop()
        for plan in self.plans.take_all():
            await self._end_session(plan.peer, plan.session)
        await self.serving.close()
        self.regions.close()

    def load(self) -> dict[str, float]:
        figures = {name: float(value) for name, value in asdict(self.counters).items()}
        serving = self.serving
        figures["num_sessions_served"] = float(serving.num_sessions_served)
        figures["num_chunks_served"] = float(serving.num_chunks_served)
        figures["num_sessions_expired"] = float(serving.num_sessions_expired)
        figures["num_sessions_open"] = float(len(serving.sessions))
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
        expected = self.peers.expected()
        if self.layout is None or not keys or not expected:
            return 0  # nobody to ask: a miss now (peers greet every hello_interval_s)
        session = secrets.token_hex(16)
        answers: asyncio.Queue[PeerHeld] = asyncio.Queue()
        self._rounds[session] = answers
        self.counters.num_rounds += 1
        try:
            lookup = PeerLookup(self.actor_id, session, self.layout, keys)
            await self.bus.publish(self.subjects.tier_peers(), encode(lookup))
            heard = await self._gather(answers, expected, len(keys))
        except BusError as exc:
            log.warning("%r: lookup round not sent: %r", self, exc)
            return 0
        finally:
            del self._rounds[session]
        while not answers.empty():  # answers that came as the round ended count too
            heard.append(answers.get_nowait())
        self.peers.missed(expected - {held.peer for held in heard})
        return await self._plan(keys, heard)

    async def _gather(
        self, answers: asyncio.Queue[PeerHeld], expected: frozenset[str], num_keys: int
    ) -> list[PeerHeld]:
        """The answers of a round, in arrival order, until every expected peer answered, one
        holds every key, or ``peer_lookup_timeout_s`` passed."""
        heard: list[PeerHeld] = []
        end = time.monotonic() + self.tier_config.peer_lookup_timeout_s
        while (left := end - time.monotonic()) > 0:
            try:
                heard.append(await asyncio.wait_for(answers.get(), left))
            except TimeoutError:
                break
            if heard[-1].num_leading >= num_keys or expected <= {h.peer for h in heard}:
                break
        return heard

    async def _plan(self, keys: list[OffloadKey], heard: list[PeerHeld]) -> int:
        """Keep the best answer as a planned pull, end every other session; its length."""
        best = best_answer(heard)
        for held in heard:
            if held.num_leading and held is not best:
                await self._end_session(held.peer, held.session)
        if best is None:
            return 0
        num = min(best.num_leading, len(keys))
        now = time.monotonic()
        replaced = self.plans.add(best.peer, best.session, keys[:num], now, best.data_address)
        if replaced is not None:
            await self._end_session(replaced.peer, replaced.session)
        self.counters.num_round_hits += 1
        self.counters.num_chunks_found += num
        return num

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
        if plan is None:
            self.counters.num_load_failures += len(job.keys)
            return TierJobDone(failed_keys=list(job.keys))
        started = time.monotonic()
        try:
            errors = await self._pull(plan, job)
        finally:
            await self._end_session(plan.peer, plan.session)
        self.counters.pull_time_s += time.monotonic() - started
        return self._settle(plan, job, errors)

    async def _pull(self, plan: PlannedPull, job: TierPromote) -> list[Exception | None]:
        """Pull into the job's slots, stopping a little before its deadline: the answer must
        reach the CPU tier while it still waits (it stops waiting at about the deadline)."""
        left = job.deadline - time.time() if job.deadline else self.tier_config.read_timeout_s
        stop = time.time() + left - min(0.25, 0.2 * left)
        if left <= 0 or job.region.layout != self.layout:
            return [TimeoutError("no time left")] * len(job.keys)
        try:
            with self.regions.use(job.region) as region:
                pulled = await pull_chunks(
                    self.bus, self.subjects, plan, region, job.keys, job.slot_ids, stop,
                    self.tier_config,
                )  # fmt: skip
        except OSError as exc:
            log.warning("%r: region %s not mapped: %s", self, job.region.path, exc)
            return [exc] * len(job.keys)
        self.counters.num_chunks_streamed += pulled.num_streamed
        return pulled.errors

    def _settle(
        self, plan: PlannedPull, job: TierPromote, errors: list[Exception | None]
    ) -> TierJobDone:
        """Done: the leading run that arrived; the rest fail (freed by the CPU tier)."""
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

    async def _end_session(self, peer: str, session: str) -> None:
        try:
            await self.bus.publish(self.subjects.tier_peer_reads(peer), encode(PeerDone(session)))
        except (BusError, ValueError) as exc:  # the peer's session ends at its time to live
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
        num = await self.serving.pin(lookup)
        address = self.channel.address if self.channel is not None and num else ""
        held = PeerHeld(self.actor_id, lookup.session, num, address)
        if not await self._answer(lookup.requester, held) and num:
            await self.serving.end(lookup.session)

    async def _answer(self, peer: str, held: PeerHeld) -> bool:
        try:
            await self.bus.publish(self.subjects.tier_peer_answers(peer), encode(held))
        except (BusError, ValueError) as exc:  # ValueError: not a valid actor id
            log.debug("%r: answer to %s not sent: %r", self, peer, exc)
            return False
        return True

    async def on_peer_request(self, request: PeerInbound, msg: Msg) -> bytes | None:
        match request:
            case PeerRead(session=session, index=index):
                return await self.serving.read(session, index)
            case PeerDone(session=session):
                await self.serving.end(session)
        return None

    # -- periodic ---------------------------------------------------------------------------

    async def _every(self, interval_s: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await job()
            except Exception:  # a bug here must not end the loop: pins would leak
                log.exception("%r: periodic %s failed", self, job.__name__)

    async def _sweep(self) -> None:
        now = time.monotonic()
        await self.serving.sweep(now)
        for plan in self.plans.expire(now):
            await self._end_session(plan.peer, plan.session)

    async def _hello(self) -> None:
        try:
            await self.bus.publish(self.subjects.tier_peers(), encode(PeerHello(self.actor_id)))
        except BusError as exc:  # the next one may pass
            log.debug("%r: hello not sent: %r", self, exc)
