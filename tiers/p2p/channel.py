"""The p2p tier's direct data path: a TCP stream from the serving host's region straight into the
asking host's region slots, where the hosts can reach each other (the bus stays the control path).

Request (asker → server): a 4-byte big-endian length and a msgpack ``PeerStream(session, start,
count)``. Reply: for each chunk in order, its part head (``tiers.secondary.chunk_format``: header
and key, the payload's xxh3-128 digest included) then the payload, sent from the serving host's
mapped
region and received into the asking host's slot (no copy in between). TCP paces the sender to
the receiver. The server closes the stream at a chunk it cannot serve (the session ended): the
asker keeps the leading chunks that arrived whole and checked.

The asker receives in a thread (blocking reads straight into the slots; its event loop stays
free). A chunk's receive starts only before the asker's stop time and every read is cut at it
(a slot is never written past the promotion's deadline); a damaged chunk (digest) fails, and its
slot is left to be freed by the CPU tier, never marked readable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.cpu.region import SharedRegion
from shoal.tiers.secondary.chunk_format import (
    CorruptChunk,
    check_head,
    head_size,
    pack_head,
    payload_digest,
)

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
_MAX_REQUEST = 4096


class PeerStream(msgspec.Struct, array_like=True):
    """Stream chunks ``start`` .. ``start + count - 1`` of ``session``."""

    session: str
    start: int
    count: int


class ChannelClosed(Exception):
    """The stream ended or failed before a chunk arrived whole."""


class ChunkSource(Protocol):
    async def chunk(self, session: str, index: int) -> tuple[memoryview, OffloadKey] | None:
        """A served chunk: its region slot (a view, released by the caller) and key; None:
        not served (the session ended)."""


class ChannelServer:
    """Accepts streams on ``host:port`` (0: any free port) and serves them from ``source``;
    at most ``max_streams`` at once (more wait to be accepted)."""

    def __init__(self, source: ChunkSource, *, max_streams: int = 8) -> None:
        self.source = source
        self.max_streams = max_streams
        self.address = ""  # "host:port" peers connect to, once started
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._streams: set[asyncio.Task[None]] = set()
        self._gate = asyncio.Semaphore(max_streams)

    async def start(self, bind_host: str, advertise_host: str, port: int = 0) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((bind_host, port))
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self.address = f"{advertise_host}:{listener.getsockname()[1]}"
        self._accepting = asyncio.create_task(self._accept_loop(listener))

    async def stop(self) -> None:
        tasks = [t for t in (self._accepting, *self._streams) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._gate.acquire()
            try:
                conn, _ = await loop.sock_accept(listener)
            except BaseException:
                self._gate.release()
                raise
            task = asyncio.create_task(self._serve(conn))
            self._streams.add(task)
            task.add_done_callback(self._streams.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            with conn:
                conn.setblocking(False)
                request = await _read_request(loop, conn)
                for index in range(request.start, request.start + request.count):
                    found = await self.source.chunk(request.session, index)
                    if found is None:
                        return  # closing tells the asker: no more
                    slot, key = found
                    with slot:
                        await loop.sock_sendall(conn, pack_head(key, slot))
                        await loop.sock_sendall(conn, slot)
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            log.debug("p2p channel: stream ended: %r", exc)
        finally:
            self._gate.release()


async def _read_request(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> PeerStream:
    async with asyncio.timeout(5.0):
        (length,) = _LENGTH.unpack(await _recv_exactly(loop, conn, _LENGTH.size))
        if length > _MAX_REQUEST:
            raise ValueError(f"request of {length} bytes")
        return msgspec.msgpack.decode(await _recv_exactly(loop, conn, length), type=PeerStream)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int) -> bytes:
    buffer = bytearray(n)
    await _recv_into(loop, conn, memoryview(buffer))
    return bytes(buffer)


async def _recv_into(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, view: memoryview
) -> None:
    got = 0
    while got < len(view):
        num = await loop.sock_recv_into(conn, view[got:])
        if num == 0:
            raise ChannelClosed(f"stream closed after {got} of {len(view)} bytes")
        got += num


@dataclass(frozen=True, slots=True)
class StreamJob:
    """Receive ``keys`` (a peer session's chunks from ``start``) into ``slot_ids`` of
    ``region``; no chunk's receive starts or goes on past ``stop`` (``time.time()``)."""

    address: str
    session: str
    start: int
    region: SharedRegion
    keys: Sequence[OffloadKey]
    slot_ids: Sequence[int]
    stop: float
    chunk_timeout_s: float


async def receive_stream(job: StreamJob) -> list[Exception | None]:
    """Each key's error (None: in its slot, checked); the keys after the first failure are not
    received. Connecting failing raises ``OSError`` (the caller may read over the bus instead).
    The chunks are received in a thread (blocking reads straight into the slots, the event
    loop left free); a cancelled caller shuts the stream, which ends the thread's read."""
    loop = asyncio.get_running_loop()
    host, port = job.address.rsplit(":", 1)
    conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    conn.setblocking(False)
    with conn:
        async with asyncio.timeout(max(0.0, min(job.chunk_timeout_s, job.stop - time.time()))):
            await loop.sock_connect(conn, (host, int(port)))
        request = msgspec.msgpack.encode(PeerStream(job.session, job.start, len(job.keys)))
        await loop.sock_sendall(conn, _LENGTH.pack(len(request)) + request)
        conn.setblocking(True)
        try:
            return await asyncio.to_thread(_receive_all, conn, job)
        finally:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def _receive_all(conn: socket.socket, job: StreamJob) -> list[Exception | None]:
    errors: list[Exception | None] = []
    for index in range(len(job.keys)):
        try:
            _receive_chunk(conn, job, index)
        except (ChannelClosed, CorruptChunk, OSError) as exc:
            rest = ChannelClosed("not received: an earlier chunk failed")
            return [*errors, exc.with_traceback(None)] + [rest] * (len(job.keys) - index - 1)
        errors.append(None)
    return errors


def _receive_chunk(conn: socket.socket, job: StreamJob, index: int) -> None:
    """One chunk into its slot; no read lasts past ``job.stop`` or the chunk's time."""
    key = job.keys[index]
    end = min(job.stop, time.time() + job.chunk_timeout_s)
    with job.region.slot(job.slot_ids[index]) as slot:
        head = bytearray(head_size(key))
        _read_into(conn, memoryview(head), end, key)
        digest = check_head(head, key, len(slot))
        _read_into(conn, slot, end, key)
        if payload_digest(slot) != digest:
            raise CorruptChunk(key, "payload digest mismatch")


def _read_into(conn: socket.socket, view: memoryview, end: float, key: OffloadKey) -> None:
    got = 0
    while got < len(view):
        left = end - time.time()
        if left <= 0:
            raise TimeoutError(f"chunk {key.hex()}: not received in its time")
        conn.settimeout(left)
        num = conn.recv_into(view[got:])
        if num == 0:
            raise ChannelClosed(f"stream closed after {got} of {len(view)} bytes")
        got += num
