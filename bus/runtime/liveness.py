"""One liveness table for peers seen through heartbeats and status events (and, optionally,
other traffic that proves a peer alive, such as an engine core's stats).

``LivenessTable`` records facts only: each peer's last state, when it was last heard from, its
last heartbeat sequence number, its incarnation and how many times it restarted. A restart is a
new incarnation (every actor sends the one it got at start, ``bus.runtime.actor``); for senders that
carry none, a heartbeat sequence that starts again or a STARTING status after it was seen. Once
a peer has a new incarnation, late messages of its old one are ignored. Its users decide what
the facts mean: the engine core's worker link fails a step when a worker restarted or fell
silent, the engine client's router sends requests only to engine cores that are READY and fresh
and the client fails the requests of one that restarted, and the recovery controller drives
retries. ``watch_liveness`` feeds a table from the bus.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from shoal.bus.base import Bus, Subscription
from shoal.bus.codec import Codec, DecodeError
from shoal.bus.messages.control import ActorState, ControlEvent, Heartbeat, StatusEvent
from shoal.bus.msg import Msg
from shoal.bus.subjects import Subjects

GONE_STATES = (ActorState.DEAD, ActorState.STOPPED)
_CONTROL: Codec[ControlEvent] = Codec(ControlEvent)


@dataclass(slots=True)
class PeerLiveness:
    """What the table knows of one peer."""

    state: ActorState
    seen_at: float  # time.monotonic() of the last sign of life
    seq: int = -1  # last heartbeat sequence number; -1: none yet
    num_restarts: int = 0
    incarnation: str = ""  # the current one; "" until one is seen (or after a reset)
    retired: set[str] = field(default_factory=set)  # earlier incarnations
    reason: str = ""  # of the last status event (an engine core's fault, while it lasts)

    def is_new(self, incarnation: str) -> bool:
        """``incarnation`` replaces a known, different one."""
        return bool(incarnation and self.incarnation and incarnation != self.incarnation)

    def restarted(self, incarnation: str) -> None:
        """Count a restart; a new ``incarnation`` retires the current one."""
        self.num_restarts += 1
        self.seq = -1  # its heartbeats count from the start again
        if self.is_new(incarnation):
            self.retired.add(self.incarnation)
        self.incarnation = incarnation or self.incarnation


class LivenessTable:
    """Peers by actor id; every method takes ``now`` (``time.monotonic()`` by default)."""

    def __init__(self) -> None:
        self.peers: dict[str, PeerLiveness] = {}

    def on_event(self, event: ControlEvent, now: float | None = None) -> bool:
        """Record ``event``; False if it was ignored (sent by a retired incarnation)."""
        now = time.monotonic() if now is None else now
        beat = event if isinstance(event, Heartbeat) else None
        peer = self.peers.get(event.actor_id)
        if peer is None:
            seq = -1 if beat is None else beat.seq
            self.peers[event.actor_id] = PeerLiveness(
                event.state,
                now,
                seq,
                incarnation=event.incarnation,
                reason=_reason(event),
            )
            return True
        if event.incarnation in peer.retired:
            return False
        if peer.is_new(event.incarnation) or (
            not (event.incarnation and peer.incarnation) and _looks_restarted(peer, event)
        ):
            peer.restarted(event.incarnation)
        peer.incarnation = event.incarnation or peer.incarnation
        if beat is not None:
            peer.seq = beat.seq
        else:
            peer.reason = _reason(event)
        peer.state, peer.seen_at = event.state, now
        return True

    def touch(
        self,
        actor_id: str,
        now: float | None = None,
        state: ActorState = ActorState.READY,
        incarnation: str = "",
    ) -> bool:
        """A sign of life other than a control event; ``state`` for a peer not seen before (or
        seen in another incarnation). False if ignored (sent by a retired incarnation)."""
        now = time.monotonic() if now is None else now
        peer = self.peers.get(actor_id)
        if peer is None:
            self.peers[actor_id] = PeerLiveness(state, now, incarnation=incarnation)
            return True
        if incarnation in peer.retired:
            return False
        if peer.is_new(incarnation):
            peer.restarted(incarnation)
            peer.state = state
        peer.incarnation = incarnation or peer.incarnation
        peer.seen_at = now
        return True

    def reset(
        self, actor_id: str, now: float | None = None, state: ActorState = ActorState.READY
    ) -> None:
        """The caller has just talked to the peer (a handshake): it is alive in ``state``, and
        its heartbeat sequence and incarnation are taken from its next heartbeat (a restart
        before this point is known; its restart count is kept)."""
        now = time.monotonic() if now is None else now
        peer = self.peers.get(actor_id)
        if peer is None:
            self.peers[actor_id] = PeerLiveness(state, now)
        else:
            peer.state, peer.seen_at, peer.seq, peer.incarnation = state, now, -1, ""

    def get(self, actor_id: str) -> PeerLiveness | None:
        return self.peers.get(actor_id)

    def num_restarts(self, actor_id: str) -> int:
        peer = self.peers.get(actor_id)
        return 0 if peer is None else peer.num_restarts

    def silent_for(self, actor_id: str, now: float | None = None) -> float | None:
        """Seconds since the peer was last heard from; None if it never was."""
        peer = self.peers.get(actor_id)
        if peer is None:
            return None
        return (time.monotonic() if now is None else now) - peer.seen_at

    def is_fresh(self, actor_id: str, within_s: float, now: float | None = None) -> bool:
        silent = self.silent_for(actor_id, now)
        return silent is not None and silent <= within_s


def _reason(event: ControlEvent) -> str:
    return event.reason if isinstance(event, StatusEvent) else ""


def _looks_restarted(peer: PeerLiveness, event: ControlEvent) -> bool:
    """Without incarnations to compare: a sequence that starts again, or STARTING again."""
    if isinstance(event, Heartbeat):
        return event.seq < peer.seq
    return event.state is ActorState.STARTING and peer.state is not ActorState.STARTING


async def watch_liveness(
    bus: Bus,
    subjects: Subjects,
    kind: str,
    table: LivenessTable,
    only: Collection[str] | None = None,
    on_change: Callable[[str], None] | None = None,
) -> list[Subscription]:
    """Feed ``table`` with the heartbeats and status events of every actor of ``kind`` (or of
    the ids in ``only``), then call ``on_change(actor_id)``; undecodable events and those of
    retired incarnations are ignored."""

    async def on_control(msg: Msg) -> None:
        try:
            event = _CONTROL.decode(msg.data)
        except DecodeError:
            return
        if only is not None and event.actor_id not in only:
            return
        if table.on_event(event) and on_change is not None:
            on_change(event.actor_id)

    return [
        await bus.subscribe(subjects.heartbeat(kind), on_control),
        await bus.subscribe(subjects.status(kind), on_control),
    ]
