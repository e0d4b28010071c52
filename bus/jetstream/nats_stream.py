"""Event streams on NATS (``NatsBus.open_stream``; semantics in ``bus.event_stream``): a
JetStream stream (file storage, limits retention), followed by an ordered push consumer that
delivers everything from the first stored message. nats-py runs a subscription's callbacks one
at a time, so the handler sees messages in stream order; the ordered consumer recreates itself
from the next sequence after a gap (e.g. a reconnect). NATS errors come out as ``BusError``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg as NatsMsg
from nats.js import JetStreamContext, api
from nats.js.client import JetStreamContext as _JS

from shoal.bus.errors import BusError
from shoal.bus.event_stream import EventStream, StreamFollower, StreamInfo
from shoal.bus.jetstream.create import open_guarded
from shoal.bus.msg import Handler, Msg
from shoal.bus.subjects import validate_subject, validate_token
from shoal.bus.transport.nats_connected import NatsConnectedBus

log = logging.getLogger(__name__)
_TIMEOUT_S = 5.0


class _NatsFollower(StreamFollower):
    def __init__(self) -> None:
        super().__init__()
        self.sub: _JS.PushSubscription | None = None

    async def stop(self) -> None:
        sub, self.sub = self.sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()


class NatsEventStream(EventStream):
    def __init__(
        self, bus: NatsConnectedBus, js: JetStreamContext, name: str, subjects: Sequence[str]
    ):
        self._bus = bus
        self._js = js
        self.name = name
        self.subjects = tuple(subjects)

    async def follow(self, handler: Handler) -> StreamFollower:
        try:
            return await self._follow(handler)
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusError(f"stream {self.name!r} not followed: {exc!r}") from exc

    async def _follow(self, handler: Handler) -> StreamFollower:
        follower = _NatsFollower()
        if (await self.info()).num_msgs == 0:
            follower.caught_up.set()
        bus = self._bus

        async def on_message(raw: NatsMsg) -> None:
            try:
                await handler(Msg(bus, raw.subject, raw.data, None, raw.headers))
            except Exception:
                log.exception("stream %s: follower's handler failed", self.name)
            follower.num_delivered += 1
            if raw.metadata.num_pending == 0:
                follower.caught_up.set()

        one = len(self.subjects) == 1
        config = api.ConsumerConfig(filter_subjects=None if one else list(self.subjects))
        follower.sub = await self._js.subscribe(
            self.subjects[0] if one else "",
            stream=self.name,
            cb=on_message,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.ALL,
            config=config,
        )
        return follower

    async def info(self) -> StreamInfo:
        try:
            state = (await self._js.stream_info(self.name)).state
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusError(f"stream {self.name!r}: no info: {exc!r}") from exc
        return StreamInfo(self.name, self.subjects, state.messages, state.first_seq, state.last_seq)

    async def purge(self) -> None:
        try:
            await self._js.purge_stream(self.name)
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusError(f"stream {self.name!r} not purged: {exc!r}") from exc


async def open_nats_stream(
    bus: NatsConnectedBus,
    name: str,
    subjects: Sequence[str],
    *,
    max_age_s: float | None = None,
    max_msgs: int | None = None,
    replicas: int = 1,
    max_msgs_per_subject: int | None = None,
) -> NatsEventStream:
    """Open JetStream stream ``name``, creating it when missing (a concurrent creation with the
    same configuration is fine; an existing stream keeps its own, subjects included: followers
    follow the subjects it has)."""
    validate_token(name, "stream name")
    for subject in subjects:
        validate_subject(subject, wildcards=True)
    js = bus.client.jetstream(timeout=_TIMEOUT_S)
    config = api.StreamConfig(
        name=name,
        subjects=list(subjects),
        max_age=max_age_s,
        max_msgs=max_msgs if max_msgs is not None else -1,
        max_msgs_per_subject=max_msgs_per_subject if max_msgs_per_subject is not None else -1,
        num_replicas=replicas,
        storage=api.StorageType.FILE,
    )
    try:
        info = await open_guarded(bus, name, f"stream {name!r}", _create_stream(js, config))
    except (nats.errors.Error, TimeoutError) as exc:
        raise BusError(f"stream {name!r} not opened: {exc!r}") from exc
    kept = info.config.subjects or list(subjects)
    if set(kept) != set(subjects):
        log.warning("stream %s captures %s, not %s: run `shoal nats-init`", name, kept, subjects)
    return NatsEventStream(bus, js, name, kept)


async def _create_stream(js: JetStreamContext, config: api.StreamConfig) -> api.StreamInfo:
    name = config.name
    assert name is not None
    try:
        return await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        try:
            return await js.add_stream(config)
        except nats.js.errors.BadRequestError:
            return await js.stream_info(name)  # created meanwhile by another actor, else raise
