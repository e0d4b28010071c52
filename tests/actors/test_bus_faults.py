"""Faults on a real nats-server: an actor process SIGKILLed under load and restarted by the
supervisor; the server itself restarted under connected clients."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from shoal.bus.codec import Codec
from shoal.bus.errors import BusError, BusTimeoutError, ConnectionLostError, NoRespondersError
from shoal.bus.messages.control import (
    ActorState,
    ControlEvent,
    Heartbeat,
    RestartAccepted,
    RestartActor,
    StatusEvent,
)
from shoal.bus.msg import Msg
from shoal.bus.nats_ops.server import NatsServer
from shoal.bus.runtime.actor import EXIT_RESTART_REQUESTED, call
from shoal.bus.runtime.supervisor import ActorSpec, ChildState, RestartPolicy, Supervisor
from shoal.bus.subjects import Subjects
from shoal.bus.transport.nats_bus import NatsBus
from tests.actors.bus_helpers import PONG_CODEC, Ping, Pong

pytestmark = pytest.mark.nats

CONTROL = Codec(ControlEvent)
ACCEPTED = Codec(RestartAccepted)
SUBJECTS = Subjects()
ECHO_SUBJECT = SUBJECTS.control("echo", "p1")
FAST_POLICY = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.5, max_restarts=3)
REQUEST_TIMEOUT_S = 1.0
STARTUP_LIMIT_S = 30.0


def echo_spec(url: str, actor_id: str = "p1") -> ActorSpec:
    return ActorSpec(
        name=actor_id,
        target="tests.actors.bus_helpers:EchoActor",
        bus_url=url,
        kwargs={"actor_id": actor_id, "heartbeat_interval_s": 0.05},
        kind="echo",
    )


async def connected_bus(url: str) -> NatsBus:
    bus = NatsBus([url])
    await bus.connect()
    return bus


async def ping_until_answered(bus: NatsBus, subject: str, *, limit_s: float) -> Pong:
    """Ping until an answer arrives (the actor may still be starting); bounded by ``limit_s``."""
    async with asyncio.timeout(limit_s):
        while True:
            try:
                return await call(bus, subject, Ping(0), PONG_CODEC, timeout=REQUEST_TIMEOUT_S)
            except (NoRespondersError, BusTimeoutError):
                await asyncio.sleep(0.05)


async def send_bounded(bus: NatsBus, seq: int) -> Pong | BusError:
    """One request; returns the reply or the bus error. A hang fails the test via wait_for."""
    request = call(bus, ECHO_SUBJECT, Ping(seq, 0.02), PONG_CODEC, timeout=REQUEST_TIMEOUT_S)
    try:
        return await asyncio.wait_for(request, REQUEST_TIMEOUT_S + 2.0)
    except BusError as exc:
        return exc


async def wait_for_busy_heartbeat(bus: NatsBus) -> None:
    busy = asyncio.Event()

    async def on_beat(msg: Msg) -> None:
        beat = CONTROL.decode(msg.data)
        if isinstance(beat, Heartbeat) and beat.load.get("inflight", 0) >= 1:
            busy.set()

    sub = await bus.subscribe(SUBJECTS.heartbeat("echo"), on_beat)
    await asyncio.wait_for(busy.wait(), STARTUP_LIMIT_S)
    await sub.unsubscribe()


async def test_sigkilled_actor_is_restarted_and_in_flight_requests_fail_cleanly(nats_url: str):
    client = await connected_bus(nats_url)
    deaths: list[StatusEvent] = []

    async def on_status(msg: Msg) -> None:
        event = CONTROL.decode(msg.data)
        if isinstance(event, StatusEvent) and event.state == ActorState.DEAD:
            deaths.append(event)

    await client.subscribe(SUBJECTS.status("echo"), on_status)
    supervisor = Supervisor([echo_spec(nats_url)], policy=FAST_POLICY, grace_s=3, status_bus=client)
    async with supervisor:
        first = await ping_until_answered(client, ECHO_SUBJECT, limit_s=STARTUP_LIMIT_S)
        assert first.pid == supervisor.pid("p1")
        # a request the actor holds for 5 s: in flight when the process is killed
        slow = asyncio.create_task(
            call(client, ECHO_SUBJECT, Ping(-1, 5.0), PONG_CODEC, timeout=REQUEST_TIMEOUT_S)
        )
        await wait_for_busy_heartbeat(client)
        os.kill(first.pid, signal.SIGKILL)
        outcomes: list[Pong | BusError] = []
        async with asyncio.timeout(STARTUP_LIMIT_S):
            for seq in range(2000):  # bounded: stops once answered by the restarted process
                outcomes.append(await send_bounded(client, seq))
                last = outcomes[-1]
                if isinstance(last, Pong) and last.pid != first.pid:
                    break
                await asyncio.sleep(0.01)  # "no responders" comes back at once: pace the retries
        with pytest.raises(BusTimeoutError):
            await asyncio.wait_for(slow, REQUEST_TIMEOUT_S + 2.0)
        later = [await send_bounded(client, 1000 + i) for i in range(5)]
        assert all(isinstance(o, Pong) and o.pid != first.pid for o in later), later
        assert all(isinstance(o, Pong | NoRespondersError | BusTimeoutError) for o in outcomes)
        assert supervisor.num_restarts("p1") == 1
        exits = [e for e in supervisor.events if e.state == ChildState.EXITED]
        assert [e.returncode for e in exits] == [-signal.SIGKILL]
        assert [(d.actor_id, d.kind) for d in deaths] == [("p1", "echo")]
    await client.close()


async def status_events(client: NatsBus) -> list[StatusEvent]:
    """Every echo actor's status events from now on, as they arrive."""
    statuses: list[StatusEvent] = []

    async def on_status(msg: Msg) -> None:
        event = CONTROL.decode(msg.data)
        if isinstance(event, StatusEvent):
            statuses.append(event)

    await client.subscribe(SUBJECTS.status("echo"), on_status)
    return statuses


async def test_supervisor_stop_drains_children_and_leaves_no_orphans(nats_url: str):
    client = await connected_bus(nats_url)
    statuses = await status_events(client)
    specs = [echo_spec(nats_url, "p2"), echo_spec(nats_url, "p3")]
    supervisor = Supervisor(specs, policy=FAST_POLICY, grace_s=3)
    await supervisor.start()
    for actor_id in ("p2", "p3"):
        await ping_until_answered(client, SUBJECTS.control("echo", actor_id), limit_s=30)
    pids = [supervisor.pid("p2"), supervisor.pid("p3")]
    await supervisor.stop()
    for pid in pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    stopped = [e for e in supervisor.events if e.state == ChildState.STOPPED]
    assert [e.returncode for e in stopped] == [0, 0]  # drained on SIGTERM, clean exit

    def stopped() -> set[str]:
        return {e.actor_id for e in statuses if e.state == ActorState.STOPPED}

    async with asyncio.timeout(10):  # sent before each child exited; still on their way here
        while stopped() != {"p2", "p3"}:
            await asyncio.sleep(0.01)  # paces the polling
    assert stopped() == {"p2", "p3"}
    await client.close()


async def test_child_that_keeps_dying_is_given_up_after_the_restart_limit(nats_url: str):
    spec = ActorSpec(name="bad", target="tests.actors.bus_helpers:Missing", bus_url=nats_url)
    policy = RestartPolicy(initial_backoff_s=0.01, max_backoff_s=0.05, max_restarts=2)
    async with Supervisor([spec], policy=policy, grace_s=1) as supervisor:
        await supervisor.wait_for("bad", ChildState.FAILED, timeout=STARTUP_LIMIT_S)
        assert supervisor.num_restarts("bad") == 2
        assert [e.state for e in supervisor.events].count(ChildState.EXITED) == 3


async def echo_after_reconnect(client: NatsBus, subject: str) -> None:
    """Request on ``subject`` (an echo) until it answers while the clients reconnect (~0.2 s
    each); bounded to 100 tries."""
    for attempt in range(100):
        try:
            reply = await client.request(subject, f"after{attempt}".encode(), timeout=0.5)
        except (BusTimeoutError, NoRespondersError, ConnectionLostError):
            await asyncio.sleep(0.05)  # paces the retries
            continue
        assert reply.data == f"after{attempt}".encode()
        return
    raise AssertionError(f"no answer on {subject!r} after the server restart")


async def test_clients_resume_subscriptions_after_server_restart(
    fresh_nats_server: NatsServer,
):
    url = fresh_nats_server.url
    responder, client = await connected_bus(url), await connected_bus(url)
    seen: list[bytes] = []

    async def echo(msg: Msg) -> None:
        seen.append(msg.data)
        await msg.respond(msg.data)

    await responder.subscribe("t.restart", echo)
    await responder.flush()
    assert (await client.request("t.restart", b"before", timeout=2)).data == b"before"
    fresh_nats_server.stop()
    fresh_nats_server.start()
    assert fresh_nats_server.url == url
    await echo_after_reconnect(client, "t.restart")
    assert responder.num_reconnects >= 1 and client.num_reconnects >= 1
    await responder.close()
    await client.close()


async def test_a_request_waiting_when_the_connection_drops_ends_at_once(
    fresh_nats_server: NatsServer,
):
    """The reply cannot come over a lost connection: the request ends with ConnectionLostError
    at once (not at its timeout), listeners learn of the reconnect, and later requests work."""
    url = fresh_nats_server.url
    responder, client = await connected_bus(url), await connected_bus(url)
    received = asyncio.Event()
    reconnects: list[int] = []
    client.on_reconnect(lambda: reconnects.append(client.num_reconnects))
    remove = responder.on_reconnect(lambda: reconnects.append(-1))
    remove()  # a removed listener is not called

    async def never_answers(msg: Msg) -> None:
        received.set()

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    await responder.subscribe("t.silent", never_answers)
    await responder.subscribe("t.echo", echo)
    await responder.flush()
    waiting = asyncio.create_task(client.request("t.silent", b"x", timeout=60))
    await asyncio.wait_for(received.wait(), 10)
    fresh_nats_server.stop()
    fresh_nats_server.start()  # back at once: nats-py reconnects and still awaits the reply
    with pytest.raises(ConnectionLostError):
        await asyncio.wait_for(waiting, 10)  # well before its 60 s timeout
    await echo_after_reconnect(client, "t.echo")
    assert reconnects == [1]
    await responder.close()
    await client.close()


def is_from_another_process(outcome: Pong | BusError, before: Pong) -> bool:
    return isinstance(outcome, Pong) and outcome.pid != before.pid


async def test_a_restart_command_drains_the_actor_and_its_supervisor_starts_a_new_life(
    nats_url: str,
):
    client = await connected_bus(nats_url)
    statuses = await status_events(client)
    policy = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.5, max_restarts=1)
    supervisor = Supervisor([echo_spec(nats_url)], policy=policy, grace_s=3, status_bus=client)
    async with supervisor:
        first = await ping_until_answered(client, ECHO_SUBJECT, limit_s=STARTUP_LIMIT_S)
        # a request in flight when the command comes is answered before the actor exits
        slow = asyncio.create_task(
            call(client, ECHO_SUBJECT, Ping(-1, 0.5), PONG_CODEC, timeout=STARTUP_LIMIT_S)
        )
        await wait_for_busy_heartbeat(client)
        for _ in range(2):  # a second one: requested restarts count against no limit
            before = await ping_until_answered(client, ECHO_SUBJECT, limit_s=STARTUP_LIMIT_S)
            command = RestartActor("test")
            accepted = await call(
                client, SUBJECTS.restart("echo", "p1"), command, ACCEPTED, timeout=5
            )
            assert (accepted.actor_id, accepted.kind) == ("p1", "echo")
            async with asyncio.timeout(STARTUP_LIMIT_S):
                while not is_from_another_process(await send_bounded(client, 0), before):
                    await asyncio.sleep(0.05)  # paces the retries while it restarts
        assert (await slow).seq == -1
        assert supervisor.num_restarts("p1") == 2 and supervisor.state("p1") is ChildState.RUNNING
        exits = [e.returncode for e in supervisor.events if e.state == ChildState.EXITED]
        assert exits == [EXIT_RESTART_REQUESTED] * 2
        assert first.pid != supervisor.pid("p1")
    assert not [e for e in statuses if e.state is ActorState.DEAD]  # a drain, not a fault
    assert len({e.incarnation for e in statuses if e.state is ActorState.READY}) == 3
    await client.close()
