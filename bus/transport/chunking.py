"""Transparent transfer of payloads larger than the transport's ``max_payload``.

The sender keeps the payload and publishes a small *manifest* message in its place: the same
subject, reply and user headers, empty data, and a ``Shoal-Chunked`` header
``<transfer subject>;<size>;<chunk size>;<blake2b-128 hex>``. Each receiver pulls the chunks by
request/reply on the transfer subject (a bounded window of requests in flight, so a slow receiver
is never flooded and cut off as a slow consumer), checks size and digest, and hands the handler
the whole message. The sender frees a payload once a reply-inbox receiver has read it all, or
after ``ttl_s`` (fan-out subjects: any number of receivers may pull it).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from typing import TYPE_CHECKING

from shoal.bus.base import ERROR_CODE_HEADER
from shoal.bus.errors import BusError, PayloadIntegrityError
from shoal.bus.msg import Msg
from shoal.bus.subjects import INBOX_ROOT, TRANSFER_PREFIX

if TYPE_CHECKING:
    from shoal.bus.base import Bus, Subscription

log = logging.getLogger(__name__)

CHUNKED_HEADER = "Shoal-Chunked"
INBOX_PREFIX = f"{INBOX_ROOT}."
DEFAULT_WINDOW = 4


def payload_digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class _Held:
    __slots__ = ("data", "expires_at", "num_chunks", "served", "single_reader")

    def __init__(self, data: bytes, num_chunks: int, single_reader: bool, expires_at: float):
        self.data = data
        self.num_chunks = num_chunks
        self.single_reader = single_reader
        self.expires_at = expires_at
        self.served: set[int] = set()


class ChunkSender:
    """Holds outgoing large payloads of one bus and serves their chunks on request, on
    ``<prefix>.<sender>.<transfer>`` (``prefix``: ``Subjects.transfer_prefix(user)`` for a bus
    connected as a user, which may subscribe there alone)."""

    def __init__(
        self, bus: Bus, chunk_size: int, *, ttl_s: float = 30.0, prefix: str = TRANSFER_PREFIX
    ) -> None:
        self._bus = bus
        self.chunk_size = chunk_size
        self._ttl_s = ttl_s
        self._prefix = f"{prefix}.{uuid.uuid4().hex}"
        self._held: dict[str, _Held] = {}
        self._sub: Subscription | None = None
        self._lock = asyncio.Lock()

    @property
    def num_held(self) -> int:
        return len(self._held)

    async def offer(
        self, subject: str, data: bytes, headers: dict[str, str] | None
    ) -> dict[str, str]:
        """Keep ``data`` for pulling; return the manifest message's headers."""
        await self._ensure_serving()
        self._expire(time.monotonic())
        transfer_id = uuid.uuid4().hex
        num_chunks = -(-len(data) // self.chunk_size)
        single = subject.startswith(INBOX_PREFIX)
        self._held[transfer_id] = _Held(data, num_chunks, single, time.monotonic() + self._ttl_s)
        manifest = f"{self._prefix}.{transfer_id};{len(data)};{self.chunk_size};"
        manifest += payload_digest(data)
        return {**(headers or {}), CHUNKED_HEADER: manifest}

    async def wrap(
        self, subject: str, data: bytes, headers: dict[str, str] | None
    ) -> tuple[bytes, dict[str, str] | None]:
        """What to publish for ``data``: itself, or (above ``chunk_size``) an empty manifest."""
        if len(data) <= self.chunk_size:
            return data, headers
        return b"", await self.offer(subject, data, headers)

    async def _ensure_serving(self) -> None:
        async with self._lock:
            if self._sub is None:
                self._sub = await self._bus.subscribe(f"{self._prefix}.*", self._serve_chunk)

    async def _serve_chunk(self, msg: Msg) -> None:
        transfer_id = msg.subject.rsplit(".", 1)[-1]
        held = self._held.get(transfer_id)
        index = int(msg.data) if msg.data.isdigit() else -1
        if held is None or not 0 <= index < held.num_chunks:
            await msg.respond(b"", headers={ERROR_CODE_HEADER: "gone"})
            return
        start = index * self.chunk_size
        await msg.respond(held.data[start : start + self.chunk_size])
        held.served.add(index)
        held.expires_at = time.monotonic() + self._ttl_s
        if held.single_reader and len(held.served) == held.num_chunks:
            self._held.pop(transfer_id, None)

    def _expire(self, now: float) -> None:
        for transfer_id in [t for t, h in self._held.items() if h.expires_at < now]:
            del self._held[transfer_id]

    async def close(self) -> None:
        self._held.clear()
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None


async def fetch_chunked(
    bus: Bus, manifest_msg: Msg, *, timeout: float, window: int = DEFAULT_WINDOW
) -> Msg:
    """Pull every chunk a manifest names, check it, and return the reassembled message."""
    headers = dict(manifest_msg.headers or {})
    manifest = headers.pop(CHUNKED_HEADER)
    try:
        transfer_subject, size_s, chunk_s, digest = manifest.split(";")
        size, chunk_size = int(size_s), int(chunk_s)
    except ValueError:
        raise PayloadIntegrityError(f"malformed chunk manifest {manifest!r}") from None
    num_chunks = -(-size // chunk_size)
    buffer = bytearray(size)
    window_slots = asyncio.Semaphore(window)

    async def pull(index: int) -> None:
        async with window_slots:
            reply = await bus.request(transfer_subject, str(index).encode(), timeout=timeout)
        if reply.header(ERROR_CODE_HEADER):
            raise PayloadIntegrityError(f"chunk {index} of {transfer_subject} is gone")
        start = index * chunk_size
        expected = min(chunk_size, size - start)
        if len(reply.data) != expected:
            raise PayloadIntegrityError(f"chunk {index}: {len(reply.data)} bytes, want {expected}")
        buffer[start : start + expected] = reply.data

    try:
        async with asyncio.TaskGroup() as group:
            for index in range(num_chunks):
                group.create_task(pull(index))
    except* BusError as failures:
        raise failures.exceptions[0] from None
    data = bytes(buffer)
    if payload_digest(data) != digest:
        raise PayloadIntegrityError(f"digest mismatch for {transfer_subject}")
    return Msg(manifest_msg._bus, manifest_msg.subject, data, manifest_msg.reply, headers or None)


def is_chunked(msg: Msg) -> bool:
    return bool(msg.headers) and CHUNKED_HEADER in msg.headers  # type: ignore[operator]


async def resolve_chunked(bus: Bus, msg: Msg, *, timeout: float) -> Msg:
    """The message as it came, or, when it is a chunk manifest, the payload reassembled."""
    return await fetch_chunked(bus, msg, timeout=timeout) if is_chunked(msg) else msg
