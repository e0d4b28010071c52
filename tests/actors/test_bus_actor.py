"""The actor runtime on both transports: typed dispatch, bad payloads, heartbeats, status, drain."""

from __future__ import annotations

import asyncio

import pytest

from shoal.bus.base import ERROR_CODE_HEADER
from shoal.bus.codec import Codec, encode
from shoal.bus.errors import RemoteError
from shoal.bus.messages.control import (
    ActorState,
    ControlEvent,
    ErrorReply,
    Heartbeat,
    RestartAccepted,
    RestartActor,
    StatusEvent,
)
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import call
from shoal.bus.streams import request_stream
from tests.actors.bus_helpers import PONG_CODEC, Count, EchoActor, Note, Ping, Pong
from tests.actors.test_bus_contract import LIMIT_S, Inbox, settle
from tests.fixtures.nats import BusFactory
from tests.integration.conditions import wait_for

CONTROL = Codec(ControlEvent)
ERROR = Codec(ErrorReply)


async def start_echo(bus_factory: BusFactory, **options: float) -> EchoActor:
    actor = EchoActor(await bus_factory(), "e1", **options)
    await actor.start()
    return actor


async def test_typed_request_and_streamed_reply(bus_factory: BusFactory):
    actor = await start_echo(bus_factory)
    client = await bus_factory()
    pong = await call(client, actor.request_subject(), Ping(7), PONG_CODEC, timeout=LIMIT_S)
    assert (pong.seq, pong.actor_id) == (7, "e1")
    stream = request_stream(client, actor.request_subject(), encode(Count(5)), timeout=LIMIT_S)
    assert [PONG_CODEC.decode(m.data).seq async for m in stream] == [0, 1, 2, 3, 4]


async def test_undecodable_request_gets_error_reply_and_actor_keeps_answering(
    bus_factory: BusFactory,
):
    actor = await start_echo(bus_factory)
    client = await bus_factory()
    subject = actor.request_subject()
    for garbage in (b"\xc1not msgpack", encode(Pong(1, 2, "x")), b""):
        reply = await client.request(subject, garbage, timeout=LIMIT_S)
        assert reply.header(ERROR_CODE_HEADER) == "undecodable"
        error = ERROR.decode(reply.data)
        assert error.code == "undecodable" and "cannot decode" in error.message
    with pytest.raises(RemoteError) as failure:
        await call(client, subject, Note("wrong type"), PONG_CODEC, timeout=LIMIT_S)
    assert failure.value.code == "undecodable"
    assert actor.num_decode_errors == 4
    pong = await call(client, subject, Ping(2), PONG_CODEC, timeout=LIMIT_S)
    assert pong.seq == 2


async def test_undecodable_event_is_counted_and_good_events_still_handled(
    bus_factory: BusFactory,
):
    actor = await start_echo(bus_factory)
    client = await bus_factory()
    await client.publish(actor.event_subject(), b"garbage")
    await client.publish(actor.event_subject(), encode(Note("hello")))
    await wait_for(lambda: actor.notes, LIMIT_S, "the note handled")
    assert actor.notes == ["hello"]
    assert actor.num_decode_errors == 1


class BrokenEcho(EchoActor):
    async def on_request(self, request: Ping | Count, msg: Msg) -> Pong | None:
        raise RuntimeError("kaput")


async def test_handler_failure_gets_internal_error_reply(bus_factory: BusFactory):
    actor = BrokenEcho(await bus_factory(), "broken")
    await actor.start()
    client = await bus_factory()
    with pytest.raises(RemoteError) as failure:
        await call(client, actor.request_subject(), Ping(1), PONG_CODEC, timeout=LIMIT_S)
    assert failure.value.code == "internal" and "kaput" in failure.value.message
    assert actor.num_handler_errors == 1


async def test_heartbeats_and_status_events(bus_factory: BusFactory):
    watcher = await bus_factory()
    beats, statuses = Inbox(), Inbox()
    subjects = EchoActor(watcher, "probe").subjects
    await watcher.subscribe(subjects.heartbeat("*"), beats)
    await watcher.subscribe(subjects.status("echo"), statuses)
    await settle(watcher)
    actor = await start_echo(bus_factory, heartbeat_interval_s=0.05)
    await beats.wait(3)
    heartbeats = [CONTROL.decode(m.data) for m in beats.msgs[:3]]
    assert all(isinstance(h, Heartbeat) for h in heartbeats)
    assert [h.seq for h in heartbeats] == [1, 2, 3]  # type: ignore[union-attr]
    assert heartbeats[0].actor_id == "e1" and heartbeats[0].kind == "echo"
    assert heartbeats[0].load == {"inflight": 0.0}  # type: ignore[union-attr]
    heartbeat_task = actor._heartbeat_task
    await actor.stop("test over")
    assert heartbeat_task is not None and heartbeat_task.done()  # stopped, not left pending
    events = [CONTROL.decode(m.data) for m in await statuses.wait(3)]
    assert all(isinstance(e, StatusEvent) for e in events)
    assert [e.state for e in events] == [ActorState.READY, ActorState.DRAINING, ActorState.STOPPED]
    assert events[-1].reason == "test over"  # type: ignore[union-attr]


async def test_run_forever_as_a_task_drains_in_flight_requests(bus_factory: BusFactory):
    actor = EchoActor(await bus_factory(), "e2")
    client = await bus_factory()
    task = asyncio.create_task(actor.run_forever(install_signals=False))
    await wait_for(lambda: actor.state == ActorState.READY, LIMIT_S, "the actor ready")
    subject = actor.request_subject()
    slow = asyncio.create_task(call(client, subject, Ping(9, 0.2), PONG_CODEC, timeout=LIMIT_S))
    await wait_for(lambda: actor.inflight > 0, LIMIT_S, "the request in flight")
    actor.request_stop()
    await asyncio.wait_for(task, LIMIT_S)
    assert (await slow).seq == 9  # answered before the actor stopped
    assert actor.state == ActorState.STOPPED


class SessionEcho(EchoActor):
    new_incarnation_on_reconnect = True


async def test_an_incarnation_is_a_life_and_for_some_actors_a_connection() -> None:
    """A bus reconnect gives a new incarnation only to actors whose peers must learn that
    messages in flight may be lost (engine cores); others keep theirs (workers: state intact)."""
    from shoal.bus.transport.memory import InMemoryBus

    bus = InMemoryBus()
    plain, session = EchoActor(bus, "p"), SessionEcho(bus, "s")
    assert plain.incarnation != EchoActor(bus, "p").incarnation  # a new life: a new one
    before = (plain.incarnation, session.incarnation)
    bus._reconnected()
    assert plain.incarnation == before[0]
    assert session.incarnation not in (before[1], "") and session.incarnation.startswith(before[1])
    assert plain.make_heartbeat().incarnation == before[0]
    assert session.make_heartbeat().incarnation == session.incarnation


def test_an_engine_core_takes_a_new_incarnation_at_each_reconnect(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """So its clients end the requests whose adds or outputs a reconnect may have lost."""
    from shoal.bus.transport.memory import InMemoryBus
    from shoal.config.deployment import ShoalConfig
    from shoal.engine.actor.core_actor import EngineCoreActor
    from shoal.workers.actor import WorkerActor

    bus = InMemoryBus()
    config = ShoalConfig.from_options(model=str(tiny_checkpoint("llama")))
    engine = EngineCoreActor(bus, "e0", config=config, worker_ids=["w0"])
    worker = WorkerActor(bus, "w0", config=config)
    before = (engine.incarnation, worker.incarnation)
    bus._reconnected()
    assert engine.incarnation != before[0] and worker.incarnation == before[1]


async def test_an_actor_sharing_its_process_refuses_a_restart_and_keeps_serving(
    bus_factory: BusFactory,
):
    actor = await start_echo(bus_factory)
    client = await bus_factory()
    restart = actor.subjects.restart("echo", "e1")
    with pytest.raises(RemoteError) as refused:
        await call(client, restart, RestartActor("test"), Codec(RestartAccepted), timeout=LIMIT_S)
    assert refused.value.code == "refused" and "shares its process" in refused.value.message
    assert actor.state is ActorState.READY and actor.exit_code == 0
    pong = await call(client, actor.request_subject(), Ping(1), PONG_CODEC, timeout=LIMIT_S)
    assert pong.seq == 1
    await actor.stop()
