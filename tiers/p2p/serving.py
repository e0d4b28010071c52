"""The serving side of a p2p tier: the sessions it holds for peers in its own host's CPU tier,
and the chunks it sends them (``bus.messages.p2p``; ``tiers.p2p.actor`` is the shell).

A peer's ``PeerLookup`` pins, in this host's CPU tier, the leading keys it holds: a
``TierLookup`` as owner ``<actor id>.<incarnation>`` asking for ``cpu`` only, so a peer's lookup
never promotes or asks further peers; the region is the CPU tier's (``TierAttach(create=False)``:
a host whose CPU tier has none, or another layout, holds nothing). The pins are renewed while
the session lasts (``TierRenew``) and handed back at ``PeerDone``, after ``session_ttl_s``, or
when the actor stops. Chunks go out as ``PeerRead`` replies on the bus or on the direct stream
(``tiers.p2p.channel``), at most ``max_concurrent_reads`` bus reads at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from shoal.bus.base import Bus
from shoal.bus.codec import Codec, DecodeError, encode
from shoal.bus.errors import BusError
from shoal.bus.messages.offload import (
    KVLayout,
    RegionRef,
    TierAttach,
    TierAttached,
    TierError,
    TierLookup,
    TierLookupReply,
    TierRelease,
    TierRenew,
)
from shoal.bus.messages.p2p import PeerLookup
from shoal.bus.runtime.actor import call
from shoal.bus.subjects import Subjects
from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.books.p2p_sessions import ServedSessions
from shoal.tiers.cpu.mapped_regions import MappedRegions
from shoal.tiers.secondary.chunk_format import pack_head

log = logging.getLogger(__name__)

_ATTACHED: Codec[TierAttached | TierError] = Codec(TierAttached | TierError)
_LOOKED_UP: Codec[TierLookupReply | TierError] = Codec(TierLookupReply | TierError)


class SessionGone(LookupError):
    """A read of a session that ended (or never was) on this host."""


class PeerServing:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        *,
        owner: str,  # whom the pins in this host's CPU tier belong to
        cpu_tier_id: str,
        regions: MappedRegions,
        session_ttl_s: float,
        cpu_tier_timeout_s: float,
        max_concurrent_reads: int = 8,
    ) -> None:
        self.bus, self.subjects, self.owner = bus, subjects, owner
        self.cpu_tier_id = cpu_tier_id
        self.regions = regions
        self.cpu_tier_timeout_s = cpu_tier_timeout_s
        self.sessions = ServedSessions(session_ttl_s)
        self.num_sessions_served = 0  # rounds answered holding chunks
        self.num_chunks_served = 0  # chunks sent (bus reads and streams)
        self.num_sessions_expired = 0  # sessions their peer never ended
        self.num_renewals = 0  # TierRenew sent for open sessions' pins
        self._reads = asyncio.Semaphore(max_concurrent_reads)
        self._region: RegionRef | None = None  # this host's CPU tier's region

    async def pin(self, lookup: PeerLookup) -> int:
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
            self._region = None
            await self._unpin(pinned, reply.generation)
            return 0
        if pinned:
            now = time.monotonic()
            replaced = self.sessions.add(
                lookup.session, lookup.requester, region, pinned, reply.slot_ids, now
            )
            if replaced is not None:  # a session id seen twice: the first one's pins go back
                await self._unpin(replaced.keys, replaced.region.generation)
            self.num_sessions_served += 1
        return len(pinned)

    async def read(self, session: str, index: int) -> bytes:
        """A chunk as a ``PeerRead`` reply: its part (head and payload); ``SessionGone``."""
        async with self._reads:
            found = await self.chunk(session, index)
            if found is None:
                raise SessionGone(f"session {session} has no chunk {index} (ended or expired)")
            slot, key = found
            return await asyncio.to_thread(_part_of, slot, key)

    async def chunk(self, session: str, index: int) -> tuple[memoryview, OffloadKey] | None:
        """The slot (a view; the caller releases it) and key of a session's chunk."""
        found = self.sessions.chunk_of(session, index, time.monotonic())
        if found is None:
            return None
        region_ref, slot_id, key = found
        with self.regions.use(region_ref) as region:
            slot = region.slot(slot_id)
        self.num_chunks_served += 1
        return slot, key

    async def end(self, session: str) -> None:
        served = self.sessions.end(session)
        if served is not None:
            await self._unpin(served.keys, served.region.generation)

    async def sweep(self, now: float) -> None:
        """End the sessions past their time to live; renew the others' pins."""
        for served in self.sessions.expire(now):
            self.num_sessions_expired += 1
            await self._unpin(served.keys, served.region.generation)
        by_generation: dict[str, list[OffloadKey]] = {}
        for served in self.sessions.open():
            by_generation.setdefault(served.region.generation, []).extend(served.keys)
        for generation, keys in by_generation.items():
            await self._publish(TierRenew(self.owner, keys, generation))
            self.num_renewals += 1

    async def close(self) -> None:
        """Hand back every session's pins (the actor stops)."""
        for served in self.sessions.expire(float("inf")):
            await self._unpin(served.keys, served.region.generation)

    async def _cpu_region(self, layout: KVLayout) -> RegionRef | None:
        """This host's CPU tier's region if it holds ``layout`` (it makes none for a peer)."""
        region = self._region
        if region is None or region.layout != layout:
            reply = await self._ask_cpu_tier(TierAttach(layout, create=False), _ATTACHED)
            if not isinstance(reply, TierAttached):
                return None
            region = self._region = reply.region
        return region

    async def _ask_cpu_tier(self, request: object, codec: Codec[Any]) -> object | None:
        subject = self.subjects.tier_in(self.cpu_tier_id)
        try:
            return await call(self.bus, subject, request, codec, timeout=self.cpu_tier_timeout_s)
        except (BusError, DecodeError) as exc:
            log.warning("p2p serving: CPU tier %s: %r", self.cpu_tier_id, exc)
            return None

    async def _unpin(self, keys: list[OffloadKey], generation: str) -> None:
        await self._publish(TierRelease(self.owner, loaded_keys=keys, generation=generation))

    async def _publish(self, message: TierRelease | TierRenew) -> None:
        try:
            await self.bus.publish(self.subjects.tier_in(self.cpu_tier_id), encode(message))
        except BusError as exc:  # the CPU tier's lease hands the pins back
            log.warning("p2p serving: %s not sent: %r", type(message).__name__, exc)


def _part_of(slot: memoryview, key: OffloadKey) -> bytes:
    """The chunk in the part format, from one copy of the slot (hashed and sent)."""
    with slot:
        payload = bytes(slot)
    return pack_head(key, payload) + payload
