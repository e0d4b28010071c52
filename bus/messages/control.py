"""Control-plane messages: heartbeats and status events from every actor, and the restart
command every actor takes on its ``Subjects.restart`` subject (``shoal restart``)."""

from __future__ import annotations

import enum

import msgspec


class ActorState(enum.IntEnum):
    STARTING = 0
    READY = 1
    DRAINING = 2
    UNHEALTHY = 3
    DEAD = 4
    STOPPED = 5


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True, omit_defaults=True):
    """Sent periodically by every actor on its kind's heartbeat subject."""

    actor_id: str
    kind: str
    seq: int
    state: ActorState
    timestamp: float
    load: dict[str, float] = {}
    incarnation: str = ""  # fixed when the actor starts: a new one means a new process
    host: str = ""  # the machine the actor runs on
    started_at: float = 0.0  # wall time this incarnation started
    engine_id: str = ""  # the engine core it serves (its own id for one; a worker's core)


class StatusEvent(msgspec.Struct, tag="status", array_like=True, omit_defaults=True):
    """A change of an actor's state, with a reason (for the recovery controller and the logs)."""

    actor_id: str
    kind: str
    state: ActorState
    timestamp: float
    reason: str = ""
    incarnation: str = ""  # the sender's (see Heartbeat); "" when another reports it (DEAD)


class ErrorReply(msgspec.Struct, tag="error", array_like=True, omit_defaults=True):
    """The reply to a request that could not be served (undecodable, invalid, overloaded…)."""

    code: str
    message: str


class RestartActor(msgspec.Struct, tag="restart", array_like=True, omit_defaults=True):
    """Ask one actor to drain and exit so that its supervisor (``shoal serve``'s, Kubernetes,
    Docker) starts it again: a new incarnation. Answered with ``RestartAccepted`` before it
    drains, or an ``ErrorReply`` (code ``refused``) by an actor that nothing would restart
    (one running inside another process)."""

    reason: str = ""


class RestartAccepted(msgspec.Struct, tag="restart_accepted", array_like=True):
    """The actor took a ``RestartActor``: ``incarnation`` is the life that is ending."""

    actor_id: str
    kind: str
    incarnation: str


ControlEvent = Heartbeat | StatusEvent
