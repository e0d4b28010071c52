"""The peer-to-peer tier's books (pure: callers pass ``now``): what it pinned for peers, what it
plans to pull from them, and which peers answer.

- ``ServedSessions`` (serving side): per session, the keys this host's CPU tier pinned for a
  peer and their slots; a session not ended by its peer within ``ttl_s`` is handed back.
- ``PlannedPulls`` (asking side): the peer and session chosen by a lookup round, kept until the
  CPU tier's promotion of those keys comes (or ``ttl_s`` passes: the peer's session is ended).
- ``PeerDirectory``: the peers heard from; a round may end as soon as all of them answered,
  and one that missed a round is not waited for again until it is heard from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shoal.bus.messages.offload import RegionRef
from shoal.bus.messages.p2p import PeerHeld
from shoal.tiers.books.keys import OffloadKey


@dataclass(frozen=True, slots=True)
class ServedSession:
    """Keys pinned in this host's CPU tier for a peer's session (``slot_ids`` co-indexed)."""

    session: str
    requester: str
    region: RegionRef
    keys: list[OffloadKey]
    slot_ids: list[int]
    expires_at: float


class ServedSessions:
    """The sessions served, by id; a session past its time to live serves no chunk."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._sessions: dict[str, ServedSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def add(
        self,
        session: str,
        requester: str,
        region: RegionRef,
        keys: Sequence[OffloadKey],
        slot_ids: Sequence[int],
        now: float,
    ) -> ServedSession | None:
        """Serve a session; the one it replaces (the same id), whose pins must go back."""
        if len(keys) != len(slot_ids):
            raise ValueError("a served session needs one slot per key")
        replaced = self._sessions.get(session)
        self._sessions[session] = ServedSession(
            session, requester, region, list(keys), list(slot_ids), now + self.ttl_s
        )
        return replaced

    def open(self) -> list[ServedSession]:
        return list(self._sessions.values())

    def chunk_of(
        self, session: str, index: int, now: float
    ) -> tuple[RegionRef, int, OffloadKey] | None:
        """The region, slot and key of a live session's ``index``-th chunk (None: none such)."""
        served = self._sessions.get(session)
        if served is None or now >= served.expires_at or not 0 <= index < len(served.keys):
            return None
        return served.region, served.slot_ids[index], served.keys[index]

    def end(self, session: str) -> ServedSession | None:
        """Forget a session; its pins to hand back (None: unknown or already ended)."""
        return self._sessions.pop(session, None)

    def expire(self, now: float) -> list[ServedSession]:
        """End every session past its time to live."""
        expired = [served for served in self._sessions.values() if now >= served.expires_at]
        for served in expired:
            del self._sessions[served.session]
        return expired


@dataclass(frozen=True, slots=True)
class PlannedPull:
    """The keys a peer pinned for ``session``: a promotion of (a prefix of) them pulls there,
    over the peer's direct stream at ``data_address`` if it has one."""

    peer: str
    session: str
    keys: list[OffloadKey]
    expires_at: float
    data_address: str = ""


class PlannedPulls:
    """The planned pulls, by their first key (a promotion names a prefix of the keys)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._by_head: dict[OffloadKey, PlannedPull] = {}

    def __len__(self) -> int:
        return len(self._by_head)

    def add(
        self,
        peer: str,
        session: str,
        keys: Sequence[OffloadKey],
        now: float,
        data_address: str = "",
    ) -> PlannedPull | None:
        """Plan a pull; the plan it replaces (same first key), whose session must be ended."""
        if not keys:
            raise ValueError("a planned pull needs keys")
        replaced = self._by_head.get(keys[0])
        plan = PlannedPull(peer, session, list(keys), now + self.ttl_s, data_address)
        self._by_head[keys[0]] = plan
        return replaced

    def take_all(self) -> list[PlannedPull]:
        """Every plan (the actor stops): their sessions must be ended."""
        plans, self._by_head = list(self._by_head.values()), {}
        return plans

    def take(self, keys: Sequence[OffloadKey], now: float) -> PlannedPull | None:
        """The live plan whose keys begin with ``keys`` (taken out); None: none such."""
        if not keys:
            return None
        plan = self._by_head.get(keys[0])
        if plan is None or now >= plan.expires_at or plan.keys[: len(keys)] != list(keys):
            return None
        del self._by_head[keys[0]]
        return plan

    def expire(self, now: float) -> list[PlannedPull]:
        """Drop every plan past its time to live; their sessions must be ended."""
        expired = [plan for plan in self._by_head.values() if now >= plan.expires_at]
        for plan in expired:
            del self._by_head[plan.keys[0]]
        return expired


class PeerDirectory:
    """The peers a lookup round waits for: every peer heard from (a hello, an answer) that has
    not missed a round since."""

    def __init__(self) -> None:
        self._peers: set[str] = set()

    def heard(self, peer: str) -> None:
        self._peers.add(peer)

    def missed(self, peers: Iterable[str]) -> None:
        """Peers that did not answer a round they were expected in (dead, or too slow)."""
        self._peers.difference_update(peers)

    def expected(self) -> frozenset[str]:
        return frozenset(self._peers)


def best_answer(answers: Sequence[PeerHeld]) -> PeerHeld | None:
    """Of the answers of a round in arrival order, the longest run (the first to arrive among
    equals); None when no peer holds any key."""
    best = None
    for held in answers:
        if held.num_leading > 0 and (best is None or held.num_leading > best.num_leading):
            best = held
    return best
