"""``shoal probe KIND ID``: an actor's readiness as its heartbeats tell it, on both buses; the
command line end to end on a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from shoal.bus.base import Bus
from shoal.bus.codec import encode
from shoal.bus.messages.control import ActorState, Heartbeat
from shoal.bus.subjects import Subjects
from shoal.bus.transport.nats_bus import NatsBus
from shoal.deploy.cli import build_parser
from shoal.deploy.probe import (
    EXIT_NOT_READY,
    EXIT_READY,
    EXIT_UNHEARD,
    actor_state,
    exit_code,
    probed_id,
    run_probe,
)
from tests.actors.bus_helpers import EchoActor

pytestmark = pytest.mark.timeout(60)
NAMESPACE = "probetest"


@contextlib.asynccontextmanager
async def beating(bus: Bus, kind: str, actor_id: str, state: ActorState) -> AsyncIterator[None]:
    """Heartbeats of ``actor_id`` in ``state`` every 50 ms (a stand-in for an actor)."""
    subject = Subjects(NAMESPACE).heartbeat(kind)

    async def beat() -> None:
        for seq in range(2000):  # bounded: 100 s at most
            event = Heartbeat(actor_id, kind, seq, state, time.time(), incarnation="i1")
            await bus.publish(subject, encode(event))
            await asyncio.sleep(0.05)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_started_actor_is_ready(bus_factory) -> None:  # type: ignore[no-untyped-def]
    actor_bus, probe_bus = await bus_factory(), await bus_factory()
    actor = EchoActor(actor_bus, "echo-1", heartbeat_interval_s=0.05, namespace=NAMESPACE)
    await actor.start()
    try:
        state = await actor_state(probe_bus, NAMESPACE, "echo", "echo-1", timeout_s=10)
    finally:
        await actor.stop()
    assert state is ActorState.READY
    assert exit_code(state, alive=False) == EXIT_READY


async def test_only_the_named_actor_counts(bus_factory) -> None:  # type: ignore[no-untyped-def]
    bus = await bus_factory()
    async with beating(bus, "engine", "engine-1", ActorState.READY):
        state = await actor_state(bus, NAMESPACE, "engine", "engine-0", timeout_s=0.5)
        assert state is None
        assert exit_code(state, alive=True) == EXIT_UNHEARD
        # another engine core beating first does not end the wait for engine-0
        probe = asyncio.create_task(actor_state(bus, NAMESPACE, "engine", "engine-0", 10))
        await asyncio.sleep(0.3)
        async with beating(bus, "engine", "engine-0", ActorState.READY):
            assert await probe is ActorState.READY


@pytest.mark.parametrize(
    ("state", "ready", "alive"),
    [
        (ActorState.STARTING, EXIT_NOT_READY, EXIT_READY),
        (ActorState.UNHEALTHY, EXIT_NOT_READY, EXIT_READY),
        (ActorState.DEAD, EXIT_NOT_READY, EXIT_NOT_READY),
    ],
)
async def test_states_other_than_ready(bus_factory, state, ready, alive) -> None:  # type: ignore[no-untyped-def]
    bus = await bus_factory()
    async with beating(bus, "worker", "worker-0-0", state):
        heard = await actor_state(bus, NAMESPACE, "worker", "worker-0-0", timeout_s=10)
    assert heard is state
    assert exit_code(heard, alive=False) == ready
    assert exit_code(heard, alive=True) == alive


async def test_command_line_on_nats(nats_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    bus = NatsBus([nats_url])
    await bus.connect()
    parser = build_parser()
    urls = f"nats://127.0.0.1:1,{nats_url}"  # a dead server first: the client tries the next
    argv = ["probe", "tier", "kv-cpu", "--nats-url", urls, "--namespace", NAMESPACE]
    async with beating(bus, "tier", "kv-cpu", ActorState.READY):
        ns = parser.parse_args([*argv, "--timeout-s", "10"])
        assert await run_probe(ns, probed_id(ns)) == EXIT_READY
    assert "tier kv-cpu: ready" in capsys.readouterr().out
    short = parser.parse_args([*argv, "--timeout-s", "0.3"])
    assert await run_probe(short, "kv-cpu") == EXIT_UNHEARD
    await bus.close()


def test_the_probe_takes_no_credentials_in_its_url(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["probe", "engine", "engine-0", "--nats-url", "nats://u:s3cret@nats-0:4222"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert "SHOAL_NATS_PASSWORD" in err and "s3cret" not in err


async def test_the_probe_takes_its_credentials_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHOAL_NATS_USER", "shoal-engine")
    monkeypatch.delenv("SHOAL_NATS_PASSWORD", raising=False)
    ns = build_parser().parse_args(["probe", "engine", "--nats-url", "nats://127.0.0.1:1"])
    assert await run_probe(ns, "engine-0") == EXIT_UNHEARD
    assert "NATS user 'shoal-engine' needs a password" in capsys.readouterr().err


def test_the_id_may_come_from_the_environment() -> None:
    parser = build_parser()
    ns = parser.parse_args(["probe", "engine", "--nats-url", "nats://nats-0:4222"])
    assert probed_id(ns, {"SHOAL_ACTOR_ID": "engine-1"}) == "engine-1"
    given = parser.parse_args(["probe", "engine", "engine-0", "--nats-url", "nats://x:4222"])
    assert probed_id(given, {"SHOAL_ACTOR_ID": "engine-1"}) == "engine-0"
    with pytest.raises(ValueError, match="SHOAL_ACTOR_ID"):
        probed_id(ns, {})
