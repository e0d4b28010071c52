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
from shoal.tiers.keys import OffloadKey


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
    ) -> None:
        if len(keys) != len(slot_ids):
            raise ValueError("a served session needs one slot per key")
        self._sessions[session] = ServedSession(
            session, requester, region, list(keys), list(slot_ids), now + self.ttl_s
        )

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
        return [self._sessions.pop(s.session) for s in list(self._sessions.values())
                if now >= s.expires_at]  # fmt: skip


@dataclass(frozen=True, slots=True)
class PlannedPull:
    """The keys a peer pinned for ``session``: a promotion of (a prefix of) them pulls there."""

    peer: str
    session: str
    keys: list[OffloadKey]
    expires_at: float


class PlannedPulls:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._by_head: dict[OffloadKey, PlannedPull] = {}

    def __len__(self) -> int:
        return len(self._by_head)

    def add(
        self, peer: str, session: str, keys: Sequence[OffloadKey], now: float
    ) -> PlannedPull | None:
        """Plan a pull; the plan it replaces (same first key), whose session must be ended."""
        if not keys:
            raise ValueError("a planned pull needs keys")
        replaced = self._by_head.get(keys[0])
        self._by_head[keys[0]] = PlannedPull(peer, session, list(keys), now + self.ttl_s)
        return replaced

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


def best_answer(answers: Sequence[tuple[str, str, int]]) -> tuple[str, str, int] | None:
    """Of ``(peer, session, num_leading)`` answers in arrival order, the longest run (the first
    to arrive among equals); None when no peer holds any key."""
    best = None
    for answer in answers:
        if answer[2] > 0 and (best is None or answer[2] > best[2]):
            best = answer
    return best
