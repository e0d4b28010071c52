"""One liveness table for peers seen through heartbeats and status events (and, optionally,
other traffic that proves a peer alive, such as an engine core's stats).

``LivenessTable`` records facts only: each peer's last state, when it was last heard from, its
last heartbeat sequence number and how many times it restarted (a heartbeat sequence that starts
again, or a STARTING status after it was seen). Its users decide what the facts mean: the engine
core's worker link fails a step when a worker restarted or fell silent, the engine client's
router sends requests only to engine cores that are READY and fresh, and the recovery controller
drives retries. ``watch_liveness`` feeds a table from the bus.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

from shoal.bus.base import Bus, Msg, Subscription
from shoal.bus.codec import Codec, DecodeError
from shoal.bus.messages.control import ActorState, ControlEvent, Heartbeat, StatusEvent
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


class LivenessTable:
    """Peers by actor id; every method takes ``now`` (``time.monotonic()`` by default)."""

    def __init__(self) -> None:
        self.peers: dict[str, PeerLiveness] = {}

    def on_event(self, event: ControlEvent, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        peer = self.peers.get(event.actor_id)
        if peer is None:
            self.peers[event.actor_id] = PeerLiveness(
                event.state, now, event.seq if isinstance(event, Heartbeat) else -1
            )
            return
        match event:
            case Heartbeat():
                if event.seq < peer.seq:
                    peer.num_restarts += 1
                peer.seq = event.seq
            case StatusEvent():
                if event.state is ActorState.STARTING and peer.state is not ActorState.STARTING:
                    peer.num_restarts += 1
                    peer.seq = -1  # its heartbeats count from the start again
        peer.state, peer.seen_at = event.state, now

    def touch(
        self, actor_id: str, now: float | None = None, state: ActorState = ActorState.READY
    ) -> None:
        """A sign of life other than a control event; ``state`` for a peer not seen before."""
        now = time.monotonic() if now is None else now
        peer = self.peers.get(actor_id)
        if peer is None:
            self.peers[actor_id] = PeerLiveness(state, now)
        else:
            peer.seen_at = now

    def reset(
        self, actor_id: str, now: float | None = None, state: ActorState = ActorState.READY
    ) -> None:
        """The caller has just talked to the peer (a handshake): it is alive in ``state``, and
        its heartbeat sequence counts from its next heartbeat (a restart before this point is
        known; its restart count is kept)."""
        now = time.monotonic() if now is None else now
        peer = self.peers.get(actor_id)
        if peer is None:
            self.peers[actor_id] = PeerLiveness(state, now)
        else:
            peer.state, peer.seen_at, peer.seq = state, now, -1

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


async def watch_liveness(
    bus: Bus,
    subjects: Subjects,
    kind: str,
    table: LivenessTable,
    only: Collection[str] | None = None,
) -> list[Subscription]:
    """Feed ``table`` with the heartbeats and status events of every actor of ``kind`` (or of
    the ids in ``only``); undecodable events are ignored."""

    async def on_control(msg: Msg) -> None:
        try:
            event = _CONTROL.decode(msg.data)
        except DecodeError:
            return
        if only is None or event.actor_id in only:
            table.on_event(event)

    return [
        await bus.subscribe(subjects.heartbeat(kind), on_control),
        await bus.subscribe(subjects.status(kind), on_control),
    ]
