"""Runs actors as separate OS processes (``python -m shoal.bus.runtime.run_actor``), restarts one
that dies (exponential backoff, a limit of restarts per time window) and stops them all cleanly
(SIGTERM, then SIGKILL after a grace period). A restarted actor rejoins by subscribing to its
subjects again. A child that exits with ``EXIT_RESTART_REQUESTED`` (``shoal restart``) is
started again at once, neither counted against the limit nor reported DEAD. Every change of a
child's state is reported to ``on_event`` and kept in ``events``."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from shoal.bus.base import Bus
from shoal.bus.codec import encode
from shoal.bus.errors import BusError
from shoal.bus.messages.control import ActorState, StatusEvent
from shoal.bus.nats_ops.credentials import SECRET_OPTIONS, url_has_secret
from shoal.bus.runtime.actor import EXIT_RESTART_REQUESTED
from shoal.bus.subjects import Subjects

log = logging.getLogger(__name__)


def _json(value: dict[str, Any]) -> str:
    """Kwargs as JSON; msgspec structs (the deployment's config) become JSON objects."""
    return msgspec.json.encode(value).decode()


# The folder holding the ``shoal`` package (a checkout's root, or site-packages), for children.
SHOAL_PARENT = Path(__file__).parents[2]


@dataclass(frozen=True)
class ActorSpec:
    """How to start one child: ``target`` is ``"module:Class"``, built as
    ``Class(bus, **kwargs)`` in the child with a bus connected to ``bus_url``."""

    name: str
    target: str
    bus_url: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    bus_options: dict[str, Any] = field(default_factory=dict, repr=False)  # may hold secrets
    env: dict[str, str] = field(default_factory=dict, repr=False)  # NATS credentials, say
    kind: str = ""  # the actor's kind, for the DEAD status the supervisor publishes

    def command(self) -> list[str]:
        """The child's command line: no secret goes here (a process listing shows it); give
        NATS credentials through ``env`` (``NatsCredentials.child_env``)."""
        secrets = set(SECRET_OPTIONS) & set(self.bus_options)
        if secrets or url_has_secret(self.bus_url):
            what = ", ".join(sorted(secrets)) or "credentials in the bus url"
            raise ValueError(f"{self.name}: {what} would show on a command line; use env")
        return [
            sys.executable, "-m", "shoal.bus.runtime.run_actor", "--target", self.target,
            "--bus", self.bus_url,
            "--kwargs", _json(self.kwargs), "--bus-options", _json(self.bus_options),
        ]  # fmt: skip


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    max_restarts: int = 5  # within window_s; one more death and the child is given up
    window_s: float = 60.0


class ChildState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    EXITED = "exited"  # died; a restart follows
    FAILED = "failed"  # died too often (or could not be spawned); given up
    STOPPED = "stopped"  # stopped by the supervisor


@dataclass(frozen=True)
class ChildEvent:
    name: str
    state: ChildState
    pid: int | None
    returncode: int | None
    num_restarts: int
    timestamp: float


class _Child:
    def __init__(self, spec: ActorSpec) -> None:
        self.spec = spec
        self.proc: asyncio.subprocess.Process | None = None
        self.state = ChildState.STARTING
        self.num_restarts = 0
        self.restart_times: list[float] = []
        self.monitor: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


def _restart_requested(returncode: int | None) -> bool:
    """The child exited because it took a ``RestartActor`` (``shoal restart``)."""
    return returncode == EXIT_RESTART_REQUESTED


class Supervisor:
    """Keeps a set of actor processes alive. ``async with Supervisor(specs) as sup: ...``

    With ``status_bus``, a child's death is also published as a ``StatusEvent`` (state DEAD) on
    its kind's status subject: a SIGKILLed actor cannot report its own death.
    """

    def __init__(
        self,
        specs: list[ActorSpec] | None = None,
        *,
        policy: RestartPolicy | None = None,
        grace_s: float = 5.0,
        on_event: Callable[[ChildEvent], None] | None = None,
        status_bus: Bus | None = None,
        namespace: str = "shoal",
    ) -> None:
        self.policy = policy or RestartPolicy()
        self.grace_s = grace_s
        self.on_event = on_event
        self.events: list[ChildEvent] = []
        self._children: dict[str, _Child] = {}
        self.status_bus = status_bus
        self._subjects = Subjects(namespace)
        self._started = False
        self._stopping = asyncio.Event()
        self._changed = asyncio.Condition()
        for spec in specs or []:
            self.add(spec)

    def add(self, spec: ActorSpec) -> None:
        if spec.name in self._children:
            raise ValueError(f"duplicate child name {spec.name!r}")
        self._children[spec.name] = _Child(spec)
        if self._started:
            self._launch(self._children[spec.name])

    def pid(self, name: str) -> int | None:
        return self._children[name].pid

    def state(self, name: str) -> ChildState:
        return self._children[name].state

    def num_restarts(self, name: str) -> int:
        return self._children[name].num_restarts

    async def start(self) -> None:
        self._started = True
        for child in self._children.values():
            self._launch(child)

    def _launch(self, child: _Child) -> None:
        child.monitor = asyncio.create_task(
            self._keep_alive(child), name=f"supervise-{child.spec.name}"
        )

    async def _report(self, child: _Child, state: ChildState, returncode: int | None = None):
        child.state = state
        event = ChildEvent(
            child.spec.name, state, child.pid, returncode, child.num_restarts, time.time()
        )
        self.events.append(event)
        log.info("child %s: %s (pid %s, rc %s)", event.name, state.value, event.pid, returncode)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                log.exception("on_event callback failed")
        requested = state is ChildState.EXITED and _restart_requested(returncode)
        if state in (ChildState.EXITED, ChildState.FAILED) and not requested:
            # (one that restarts on request said STOPPED itself, drained: no fault)
            await self._publish_death(child, state, returncode)
        async with self._changed:
            self._changed.notify_all()

    async def _publish_death(self, child: _Child, state: ChildState, rc: int | None) -> None:
        if self.status_bus is None or not child.spec.kind:
            return
        actor_id = str(child.spec.kwargs.get("actor_id", child.spec.name))
        reason = f"process {state.value} with exit code {rc}"
        event = StatusEvent(actor_id, child.spec.kind, ActorState.DEAD, time.time(), reason)
        try:
            await self.status_bus.publish(self._subjects.status(child.spec.kind), encode(event))
        except BusError as exc:
            log.warning("death of %s not published: %r", child.spec.name, exc)

    async def _spawn(self, child: _Child) -> None:
        env = {**os.environ, **child.spec.env}
        paths = [str(SHOAL_PARENT), os.getcwd(), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        child.proc = await asyncio.create_subprocess_exec(*child.spec.command(), env=env)
        await self._report(child, ChildState.RUNNING)

    async def _keep_alive(self, child: _Child) -> None:
        consecutive = 0
        while not self._stopping.is_set():
            await self._report(child, ChildState.STARTING)
            try:
                await self._spawn(child)
            except OSError:
                log.exception("cannot spawn %s", child.spec.name)
                await self._report(child, ChildState.FAILED)
                return
            assert child.proc is not None
            if self._stopping.is_set():  # stop() began while this child was spawning
                await self._terminate(child.proc)
            started = time.monotonic()
            returncode = await child.proc.wait()
            if self._stopping.is_set():
                break
            await self._report(child, ChildState.EXITED, returncode)
            requested = _restart_requested(returncode)
            if not requested and not self._may_restart(child):
                await self._report(child, ChildState.FAILED, returncode)
                return
            ran_long = time.monotonic() - started > self.policy.window_s
            consecutive = 0 if ran_long or requested else consecutive + 1
            backoff = self.policy.initial_backoff_s * 2 ** max(0, consecutive - 1)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._stopping.wait(), min(backoff, self.policy.max_backoff_s)
                )
            child.num_restarts += 1
        await self._report(child, ChildState.STOPPED, child.proc.returncode if child.proc else None)

    def _may_restart(self, child: _Child) -> bool:
        now = time.monotonic()
        recent = [t for t in child.restart_times if now - t < self.policy.window_s]
        child.restart_times = [*recent, now]
        return len(recent) < self.policy.max_restarts

    async def wait_for(
        self, name: str, state: ChildState, *, timeout: float, min_restarts: int = 0
    ) -> None:
        """Wait until child ``name`` is in ``state`` (after at least ``min_restarts``)."""
        child = self._children[name]

        def reached() -> bool:
            return child.state == state and child.num_restarts >= min_restarts

        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(reached)

    async def _terminate(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM, then SIGKILL if still alive after ``grace_s``; returns once it is reaped."""
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.grace_s)
        except TimeoutError:
            log.warning("child pid %s ignored SIGTERM for %.1fs: SIGKILL", proc.pid, self.grace_s)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def stop(self) -> None:
        """SIGTERM every child, SIGKILL those still alive after ``grace_s``; wait for all."""
        self._stopping.set()
        procs = [c.proc for c in self._children.values() if c.proc and c.proc.returncode is None]
        await asyncio.gather(*(self._terminate(p) for p in procs))
        monitors = [c.monitor for c in self._children.values() if c.monitor is not None]
        if monitors:
            await asyncio.gather(*monitors, return_exceptions=True)

    async def __aenter__(self) -> Supervisor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
