"""The Object Store (``bus.jetstream.object_store``) cut short or raced, against a real
nats-server: two clients (two hosts) on one bucket.

A read takes direct gets and makes no consumer; a chunk a direct get does not find (a replica
behind the leader) or a stream without direct gets sends the read to a consumer, which returns
the object. A read whose chunks are purged while it reads fails at once (not at its timeout),
and one whose object was put again meanwhile is a miss (None), whether the old chunks went
before its first chunk, after it, or while the consumer pulls; a listing or a read cut short
leaves no subscription or consumer behind (a bucket whose stream is gone lists empty); of
overlapping puts of one name the first to publish wins and the loser's chunk messages are
purged; a delete spares a put of the name that lands while it runs, and a put publishes again
over a delete that landed under it; ``close`` waits for the purges still running, within its
bound."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import nats.js.errors
import pytest

from shoal.bus.errors import BusTimeoutError, PayloadIntegrityError
from shoal.bus.jetstream import object_store
from shoal.bus.jetstream.object_store import CHUNK_BYTES, NatsObjectStore
from shoal.bus.nats_ops.server import NatsServer
from shoal.bus.transport.nats_bus import NatsBus
from tests.integration.conditions import wait_for

pytestmark = pytest.mark.nats

REPLY_S = 5.0
QUICK_S = 2.0  # what a read or a clean-up may take here; the timeouts it must beat are longer
Action = Callable[[], Awaitable[None]]


@pytest.fixture
async def stores(nats_url: str) -> AsyncIterator[tuple[NatsObjectStore, NatsObjectStore]]:
    buses = [NatsBus([nats_url]), NatsBus([nats_url])]
    for bus in buses:
        await bus.connect()
    bucket = f"objs{secrets.token_hex(4)}"
    a, b = [await NatsObjectStore.open(bus, bucket) for bus in buses]
    yield a, b
    for store in (a, b):
        await store.close()
    for bus in buses:
        await bus.close()


def js_of(store: NatsObjectStore) -> Any:
    """The store's JetStream context, whose calls a test hooks."""
    return store._js


async def chunk_subjects(store: NatsObjectStore) -> dict[str, int]:
    info = await js_of(store).stream_info(store._stream, subjects_filter=f"$O.{store.name}.C.>")
    return dict(info.state.subjects or {})


async def num_consumers(store: NatsObjectStore) -> int:
    return int((await js_of(store).stream_info(store._stream)).state.consumer_count)


async def purge_chunks(store: NatsObjectStore, name: str) -> None:
    """What the object's writer's budget does to its chunks (another host reading it)."""
    info = await store._store.get_info(name)
    await js_of(store).purge_stream(store._stream, subject=f"$O.{store.name}.C.{info.nuid}")


async def put_again(store: NatsObjectStore, name: str, data: bytes) -> None:
    """Another host puts the name again; once this returns, the old chunks are purged."""
    assert await store.put(name, data)
    await wait_for(lambda: store.num_orphans == 0, REPLY_S, "the replaced chunks purged")


def hold(store: NatsObjectStore, method: str, match: Callable[..., bool] = lambda *a, **k: True):
    """Hold the first call of the store's JetStream ``method`` that ``match`` accepts until
    ``release`` is set (bounded); ``held`` is set once it is held."""
    js = js_of(store)
    real, held, release = getattr(js, method), asyncio.Event(), asyncio.Event()

    async def call(*args: Any, **kwargs: Any) -> Any:
        if not held.is_set() and match(*args, **kwargs):
            held.set()
            await asyncio.wait_for(release.wait(), REPLY_S)
        return await real(*args, **kwargs)

    setattr(js, method, call)
    return held, release


class Silent(asyncio.Queue[Any]):
    """A watcher's queue that nothing reaches (the server stopped answering)."""

    async def put(self, item: Any) -> None:
        return None


def is_meta(subject: str, *args: Any, **kwargs: Any) -> bool:
    return ".M." in subject


def at_direct_get(store: NatsObjectStore, action: Action, *, after: bool) -> None:
    """Run ``action`` before the store's next read asks for its first chunk by a direct get
    (its meta read, no chunk yet), or ``after`` that chunk arrived."""
    js = js_of(store)
    real = js.get_msg

    async def get_msg(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("direct"):
            return await real(*args, **kwargs)
        js.get_msg = real
        if not after:
            await action()
        msg = await real(*args, **kwargs)
        if after:
            await action()
        return msg

    js.get_msg = get_msg


def direct_gets(store: NatsObjectStore, *, lagging: int | None = None) -> list[int]:
    """The direct gets the store asks for from now on (a list growing by one per get), the one
    numbered ``lagging`` (0: the first) answered by a replica behind the leader: not found."""
    js, asked = js_of(store), []
    real = js.get_msg

    async def get_msg(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("direct"):
            asked.append(kwargs.get("seq", 0))
            if len(asked) - 1 == lagging:
                raise nats.js.errors.NotFoundError
        return await real(*args, **kwargs)

    js.get_msg = get_msg
    return asked


def consumers_made(store: NatsObjectStore) -> list[Any]:
    """The configs of the consumers the store's reads create from now on."""
    js, made = js_of(store), []
    real = js.add_consumer

    async def add_consumer(*args: Any, **kwargs: Any) -> Any:
        made.append(kwargs.get("config"))
        return await real(*args, **kwargs)

    js.add_consumer = add_consumer
    return made


def after_first_pull(store: NatsObjectStore, action: Action) -> None:
    """Run ``action`` once the store's next consumer read has pulled its first batch."""
    js = js_of(store)
    real = js.pull_subscribe_bind

    async def bind(*args: Any, **kwargs: Any) -> Any:
        js.pull_subscribe_bind = real
        sub = await real(*args, **kwargs)
        fetch = sub.fetch

        async def first_fetch(*fargs: Any, **fkwargs: Any) -> Any:
            sub.fetch = fetch
            msgs = await fetch(*fargs, **fkwargs)
            await action()
            return msgs

        sub.fetch = first_fetch
        return sub

    js.pull_subscribe_bind = bind


async def test_a_read_takes_direct_gets_and_makes_no_consumer(
    stores: tuple[NatsObjectStore, NatsObjectStore],
) -> None:
    a, b = stores
    data = os.urandom(2 * CHUNK_BYTES + 1000)
    await b.put("x", data)
    asked, made = direct_gets(a), consumers_made(a)
    assert await a.get("x") == data
    assert len(asked) == 3 and made == []
    assert await num_consumers(a) == 0


async def test_a_chunk_a_replica_behind_lacks_is_read_from_the_leader(
    stores: tuple[NatsObjectStore, NatsObjectStore],
) -> None:
    """The second chunk's direct get is not found (a replica behind the leader): the read goes
    to a consumer (the leader's view), returns the object, and deletes its consumer."""
    a, b = stores
    data = os.urandom(3 * CHUNK_BYTES)
    await b.put("x", data)
    asked, made = direct_gets(a, lagging=1), consumers_made(a)
    async with asyncio.timeout(QUICK_S):
        assert await a.get("x") == data
    assert len(asked) == 2 and len(made) == 1
    await wait_for(lambda: not a._purges, REPLY_S, "the consumer's delete ran")
    assert await num_consumers(a) == 0


async def test_a_stream_without_direct_gets_is_read_through_a_consumer(
    stores: tuple[NatsObjectStore, NatsObjectStore],
) -> None:
    """A bucket whose stream answers no direct gets (``allow_direct`` off)."""
    a, b = stores
    data = os.urandom(CHUNK_BYTES + 1)
    await b.put("x", data)
    config = (await js_of(a).stream_info(a._stream)).config
    config.allow_direct = False
    await js_of(a).update_stream(config)
    made = consumers_made(a)
    async with asyncio.timeout(QUICK_S):
        assert await a.get("x") == data
    assert len(made) == 1


async def test_reads_by_direct_gets_keep_what_is_queued_to_the_client_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """64 reads at once of one-chunk objects (8 MiB) from a server that drops a client with
    more than 2 MiB queued to it: ``DIRECT_READS`` (4 here) are on their way at once."""
    monkeypatch.setattr(object_store, "DIRECT_READS", 4)
    data = [os.urandom(CHUNK_BYTES) for _ in range(64)]
    with NatsServer(max_payload=CHUNK_BYTES * 2, extra_config="max_pending: 2MB") as server:
        bus = NatsBus([server.url])
        await bus.connect()
        store = await NatsObjectStore.open(bus, "bounded")
        for i, one in enumerate(data):
            await store.put(f"o{i}", one)
        async with asyncio.timeout(QUICK_S * 2):
            reads = [store.get(f"o{i}", timeout=QUICK_S) for i in range(64)]
            assert await asyncio.gather(*reads) == data
        await store.close()
        await bus.close()


@pytest.mark.parametrize(
    "what, when, found",
    [
        ("purged", "before read", 0),
        ("purged", "while read", 0),  # the consumer the missing chunk sends it to finds none
        ("purged", "while the consumer reads", 2),
        ("put again", "before read", 0),
        ("put again", "while read", 0),
        ("put again", "while the consumer reads", 0),
    ],
)
async def test_a_read_whose_chunks_go_ends_at_once(
    stores: tuple[NatsObjectStore, NatsObjectStore],
    monkeypatch: pytest.MonkeyPatch,
    what: str,
    when: str,
    found: int,
) -> None:
    """Purged (the writer's budget deleted it): ``PayloadIntegrityError`` at once, not at the
    read's timeout. Put again by another host: a miss (None), the new object left alone. Before
    the first chunk's direct get, after it, or while the consumer a replica behind the leader
    sent the read to pulls."""
    a, b = stores
    monkeypatch.setattr(object_store, "FETCH_BATCH", 2)  # five chunks: a consumer pulls thrice
    await a.put("x", b"1" * (5 * CHUNK_BYTES))
    new = b"2" * (3 * CHUNK_BYTES)

    async def action() -> None:
        await (purge_chunks(b, "x") if what == "purged" else put_again(b, "x", new))

    if when == "while the consumer reads":
        direct_gets(a, lagging=0)
        after_first_pull(a, action)
    else:
        at_direct_get(a, action, after=when == "while read")
    async with asyncio.timeout(QUICK_S):  # the read's own timeout is far longer
        if what == "purged":
            with pytest.raises(PayloadIntegrityError, match=f"{found} of 5 chunks"):
                await a.get("x", timeout=30.0)
        else:
            assert await a.get("x", timeout=30.0) is None
    if what == "put again":
        assert await a.get("x") == new


@pytest.mark.parametrize("when", ["opening", "listing"])
async def test_a_listing_cut_short_leaves_no_watcher(
    stores: tuple[NatsObjectStore, NatsObjectStore], when: str
) -> None:
    """Cut short while nats-py opens its watcher (a cancellation) or while the listing waits
    for the next entry (a timeout: the server stopped answering), the watcher's subscription
    goes all the same."""
    a, _ = stores
    await a.put("x", b"1")
    client = js_of(a)._nc
    num_subs = len(client._subs)
    real, opened, release = a._store.watch, asyncio.Event(), asyncio.Event()

    async def watch(**kwargs: Any) -> Any:
        watcher = await real(**kwargs)
        opened.set()
        if when == "opening":
            await asyncio.wait_for(release.wait(), REPLY_S)
        else:
            watcher._updates = Silent()  # nothing comes any more
        return watcher

    a._store.watch = watch  # type: ignore[method-assign]
    listing = asyncio.create_task(a.list())
    await asyncio.wait_for(opened.wait(), REPLY_S)
    if when == "opening":
        listing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listing
        release.set()
    else:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(listing, 0.2)
    await wait_for(lambda: len(client._subs) == num_subs, QUICK_S, "the watcher stopped")


async def test_a_bucket_whose_stream_is_gone_lists_empty(
    stores: tuple[NatsObjectStore, NatsObjectStore],
) -> None:
    a, _ = stores
    await a.put("x", b"1")
    await js_of(a).delete_stream(a._stream)
    assert await a.list() == []


async def test_a_read_cancelled_while_its_consumer_is_created_leaves_none(
    stores: tuple[NatsObjectStore, NatsObjectStore],
) -> None:
    a, _ = stores
    await a.put("x", b"1" * 1000)
    real, created = js_of(a).add_consumer, asyncio.Event()

    async def add_consumer(*args: Any, **kwargs: Any) -> Any:
        info = await real(*args, **kwargs)
        created.set()
        await asyncio.wait_for(asyncio.Event().wait(), REPLY_S)  # the cancellation comes here
        return info

    js_of(a).add_consumer = add_consumer
    direct_gets(a, lagging=0)  # consumers are made only by reads a direct get failed
    read = asyncio.create_task(a.get("x"))
    await asyncio.wait_for(created.wait(), REPLY_S)
    assert await num_consumers(a) == 1
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    for _ in range(100):  # bounded: the delete runs in a task; the server's own takes 30 s
        if await num_consumers(a) == 0:
            break
        await asyncio.sleep(0.02)
    assert await num_consumers(a) == 0


async def test_of_overlapping_puts_of_a_name_the_first_to_publish_wins(
    stores: tuple[NatsObjectStore, NatsObjectStore],
) -> None:
    """Two hosts cascade one chunk: A's chunks are in the stream when B's put publishes; A's
    meta is refused, A purges its chunks, and B's object is the one read."""
    a, b = stores
    mine, theirs = os.urandom(3 * CHUNK_BYTES), os.urandom(2 * CHUNK_BYTES)
    held, release = hold(a, "publish", is_meta)
    put = asyncio.create_task(a.put("k", mine, writer="A"))
    await asyncio.wait_for(held.wait(), REPLY_S)
    assert await b.put("k", theirs, writer="B")
    release.set()
    assert await put is False
    await wait_for(lambda: a.num_orphans == 0, REPLY_S, "the loser's chunks purged")
    assert list((await chunk_subjects(a)).values()) == [2]  # B's two chunks only
    entry = await a.info("k")
    assert entry is not None and entry.writer == "B"
    assert await a.get("k") == theirs


async def test_a_delete_spares_a_put_that_lands_while_it_runs(
    stores: tuple[NatsObjectStore, NatsObjectStore],
) -> None:
    """A deletes the object (its chunks purged, the delete held before its meta's purge) while
    B puts the name again: B's newer meta and chunks stay."""
    a, b = stores
    await a.put("d", b"1" * CHUNK_BYTES)
    new = os.urandom(2 * CHUNK_BYTES)
    held, release = hold(a, "purge_stream", lambda *args, subject="", **kw: ".M." in subject)
    delete = asyncio.create_task(a.delete("d"))
    await asyncio.wait_for(held.wait(), REPLY_S)
    assert await b.put("d", new, writer="B")
    release.set()
    assert await delete is True
    assert await a.get("d") == new
    await wait_for(lambda: b.num_orphans == 0, REPLY_S, "the old chunks purged")
    assert list((await chunk_subjects(a)).values()) == [2]


async def test_a_put_publishes_again_over_a_delete_that_landed_under_it(
    stores: tuple[NatsObjectStore, NatsObjectStore],
) -> None:
    a, b = stores
    await a.put("d", b"1" * CHUNK_BYTES)
    new = os.urandom(2 * CHUNK_BYTES)
    held, release = hold(b, "publish", is_meta)
    put = asyncio.create_task(b.put("d", new, writer="B"))
    await asyncio.wait_for(held.wait(), REPLY_S)
    assert await a.delete("d")
    release.set()
    assert await put is True
    assert await a.get("d") == new


async def test_close_waits_for_the_purges_still_running_within_its_bound(
    stores: tuple[NatsObjectStore, NatsObjectStore],
) -> None:
    a, _ = stores
    for bounded in (False, True):
        held, _ = hold(a, "publish")  # the first chunk's publish: the put is cut there
        put = asyncio.create_task(a.put(f"cut{bounded}", b"1" * CHUNK_BYTES))
        await asyncio.wait_for(held.wait(), REPLY_S)
        if bounded:  # its purge hangs (the server does not answer)
            hold(a, "purge_stream")
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        assert a.num_orphans == 1
        async with asyncio.timeout(QUICK_S):
            await a.close(timeout=0.2)
        assert not a._purges
        assert a.num_orphans == (1 if bounded else 0)  # a hung purge: left for the next put


async def test_a_read_whose_direct_get_hangs_ends_at_its_timeout(
    stores: tuple[NatsObjectStore, NatsObjectStore],
) -> None:
    a, b = stores
    await b.put("x", b"1" * CHUNK_BYTES)
    held, release = hold(a, "get_msg", lambda *args, direct=False, **kw: direct)
    async with asyncio.timeout(QUICK_S):
        with pytest.raises(BusTimeoutError, match="0/131072 bytes"):
            await a.get("x", timeout=0.3)
    assert held.is_set()
    release.set()
