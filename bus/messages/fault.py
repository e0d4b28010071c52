"""Fault-tolerance messages: recovery commands to an engine core and fault injection for tests.

An engine core serves ``EngineControl`` on ``subjects.control("engine", engine_id)`` even while
its step loop is blocked waiting for recovery: ``FaultToleranceRequest`` (vLLM's spelling; the
only instruction is ``retry``, accepted only while the engine core is UNHEALTHY) is answered
with ``FaultToleranceResult``; ``InjectFault`` makes it raise in its step loop (tests and
``bench/recovery.py``). A worker takes ``InjectFault`` in its inbox and fails a step with it.

Engine status names on the HTTP API are vLLM's: ``healthy`` (READY), ``unhealthy`` (faulted,
its workers alive, waiting for ``retry``) and ``dead`` (a worker gone).
"""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.bus.messages.control import ActorState

RETRY = "retry"
INSTRUCTIONS = (RETRY,)


class FaultToleranceRequest(msgspec.Struct, tag="ft_request", array_like=True, omit_defaults=True):
    """A recovery command for one engine core."""

    instruction: str
    params: dict[str, Any] = {}
    request_id: str = ""


class FaultToleranceResult(msgspec.Struct, tag="ft_result", array_like=True, omit_defaults=True):
    """The answer to a ``FaultToleranceRequest``; ``reason`` says why it was rejected or failed."""

    request_id: str
    success: bool
    reason: str | None = None


class InjectFault(msgspec.Struct, tag="inject_fault", array_like=True, omit_defaults=True):
    """Raise ``InjectedFault(message)`` at this actor's ``after_steps``-th step from now
    (0: the next one). An engine core raises in its step loop; a worker fails the step's
    forward pass (a fatal error for the whole batch). Answered with ``FaultInjected``."""

    after_steps: int = 0
    message: str = "injected fault"


class FaultInjected(msgspec.Struct, tag="fault_injected", array_like=True, omit_defaults=True):
    """Reply to ``InjectFault``: armed, to fire at the actor's step ``at_step``."""

    actor_id: str
    at_step: int


class InjectedFault(RuntimeError):
    """The exception an ``InjectFault`` raises."""


EngineControl = FaultToleranceRequest | InjectFault
EngineControlReply = FaultToleranceResult | FaultInjected


def status_name(state: ActorState) -> str:
    """An engine core's state as vLLM's fault-tolerance API names it."""
    if state is ActorState.READY:
        return "healthy"
    if state in (ActorState.DEAD, ActorState.STOPPED):
        return "dead"
    return state.name.lower()  # unhealthy, starting, draining
