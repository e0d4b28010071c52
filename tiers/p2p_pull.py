"""Pulling a peer's pinned chunks into this host's region slots (the asking side of a p2p
promotion; ``bus.messages.p2p``).

One ``PeerRead`` request per chunk, at most ``window`` in flight: the peer sends a chunk only
when asked, and the bus carries a reply larger than its payload limit in chunks it pulls too
(``bus.chunking``), so a large transfer never floods a slow receiver. Each reply is checked
(the part format's header, key, length and xxh3 digest) and copied into its slot in a thread,
only before the job's deadline. No read is issued after one failed: the caller keeps the
leading run that arrived.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.bus.base import ERROR_CODE_HEADER, Bus, BusError
from shoal.bus.codec import encode
from shoal.bus.messages.p2p import PeerRead
from shoal.tiers.chunk_format import (
    CorruptChunk,
    DeadlinePassed,
    check_deadline,
    check_head,
    head_size,
    payload_digest,
)
from shoal.tiers.keys import OffloadKey
from shoal.tiers.region import SharedRegion


class PeerReadFailed(Exception):
    """The peer did not send the chunk (gone, timed out, or the session ended there)."""


@dataclass(frozen=True, slots=True)
class PullJob:
    """Where the pulled chunks go: ``keys`` (the peer session's leading keys) into
    ``slot_ids`` of ``region``, none touched after ``deadline`` (``time.time()``)."""

    subject: str  # the peer's ``subjects.tier_peer_reads``
    session: str
    region: SharedRegion
    keys: Sequence[OffloadKey]
    slot_ids: Sequence[int]
    deadline: float


async def pull_run(
    bus: Bus, job: PullJob, *, window: int, read_timeout_s: float
) -> list[Exception | None]:
    """Each key's error (None: in its slot now); keys not asked for, after a failure, carry the
    ``PeerReadFailed`` that stopped the run."""
    gate = asyncio.Semaphore(window)
    stopped: list[Exception] = []

    async def pull(index: int) -> Exception | None:
        async with gate:
            if stopped:
                return stopped[0]
            try:
                await _read_into_slot(bus, job, index, read_timeout_s)
            except (PeerReadFailed, CorruptChunk, DeadlinePassed, OSError, ValueError) as exc:
                stopped.append(exc)
                return exc.with_traceback(None)
        return None

    return list(await asyncio.gather(*(pull(i) for i in range(len(job.keys)))))


async def _read_into_slot(bus: Bus, job: PullJob, index: int, read_timeout_s: float) -> None:
    key = job.keys[index]
    try:
        reply = await bus.request(
            job.subject, encode(PeerRead(job.session, index)), timeout=read_timeout_s
        )
    except BusError as exc:
        raise PeerReadFailed(f"chunk {key.hex()}: {exc!r}") from None
    if reply.header(ERROR_CODE_HEADER):
        raise PeerReadFailed(f"chunk {key.hex()}: {reply.data.decode(errors='replace')}")
    await asyncio.to_thread(_check_and_copy, job, index, reply.data)


def _check_and_copy(job: PullJob, index: int, part: bytes) -> None:
    key = job.keys[index]
    with job.region.slot(job.slot_ids[index]) as slot:
        start = head_size(key)
        digest = check_head(part, key, len(slot))
        if len(part) != start + len(slot):
            raise CorruptChunk(key, f"{len(part) - start} bytes sent, not {len(slot)}")
        payload = memoryview(part)[start:]
        if payload_digest(payload) != digest:
            raise CorruptChunk(key, "payload digest mismatch")
        check_deadline(key, job.deadline)
        slot[:] = payload
