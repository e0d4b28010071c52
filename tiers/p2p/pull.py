"""Pulling a peer's pinned chunks into this host's region slots (the asking side of a p2p
promotion; ``bus.messages.p2p``): over the direct stream (``tiers.p2p.channel``) when the peer
offers one and it connects, else over the bus.

Over the bus: one ``PeerRead`` request per chunk, at most ``window`` in flight: the peer sends
a chunk only when asked, and the bus carries a reply larger than its payload limit in chunks it
pulls too (``bus.transport.chunking``), so a large transfer never floods a slow receiver. Each
reply is checked (the part format's header, key, length and xxh3 digest) and copied into its slot
in a thread. No read is issued after one failed or past the job's stop time, and each read is cut
at it: the caller keeps the leading run that arrived, in time to answer the CPU tier.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.bus.base import ERROR_CODE_HEADER, Bus
from shoal.bus.codec import encode
from shoal.bus.errors import BusError
from shoal.bus.messages.p2p import PeerRead
from shoal.bus.subjects import Subjects
from shoal.config.kv_transfer import P2PTierConfig
from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.books.p2p_sessions import PlannedPull
from shoal.tiers.cpu.region import SharedRegion
from shoal.tiers.p2p.channel import StreamJob, receive_stream
from shoal.tiers.secondary.chunk_format import CorruptChunk, check_head, head_size, payload_digest

log = logging.getLogger(__name__)


class PeerReadFailed(Exception):
    """The peer did not send the chunk (gone, timed out, or the session ended there)."""


@dataclass(frozen=True, slots=True)
class PullJob:
    """Where the pulled chunks go: ``keys`` (the peer session's leading keys) into
    ``slot_ids`` of ``region``; no read starts or goes on past ``stop`` (``time.time()``, a
    little before the promotion's deadline)."""

    subject: str  # the peer's ``subjects.tier_peer_reads``
    session: str
    region: SharedRegion
    keys: Sequence[OffloadKey]
    slot_ids: Sequence[int]
    stop: float


async def pull_run(
    bus: Bus, job: PullJob, *, window: int, read_timeout_s: float
) -> list[Exception | None]:
    """Each key's error (None: in its slot now); keys not asked for after a failure carry a
    ``PeerReadFailed``."""
    gate = asyncio.Semaphore(window)
    stopped: list[Exception] = []

    async def pull(index: int) -> Exception | None:
        async with gate:
            if stopped:
                return PeerReadFailed(f"chunk {index}: not read, an earlier one failed")
            try:
                left = job.stop - time.time()
                if left <= 0:
                    raise PeerReadFailed(f"chunk {index}: the promotion's time is up")
                async with asyncio.timeout(min(read_timeout_s, left)):
                    await _read_into_slot(bus, job, index)
            except (PeerReadFailed, CorruptChunk, OSError, ValueError, TimeoutError) as exc:
                stopped.append(exc)
                return exc.with_traceback(None)
        return None

    return list(await asyncio.gather(*(pull(i) for i in range(len(job.keys)))))


async def _read_into_slot(bus: Bus, job: PullJob, index: int) -> None:
    """One read, bounded by the caller (``asyncio.timeout``: a chunked reply's pieces too)."""
    key = job.keys[index]
    try:
        reply = await bus.request(
            job.subject, encode(PeerRead(job.session, index)), timeout=job.stop - time.time()
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
        if time.time() > job.stop:
            raise PeerReadFailed(f"chunk {key.hex()}: arrived after the promotion's time")
        slot[:] = payload


@dataclass(frozen=True, slots=True)
class Pulled:
    errors: list[Exception | None]  # per key (None: in its slot)
    num_streamed: int  # chunks that came over the direct stream


async def pull_chunks(
    bus: Bus,
    subjects: Subjects,
    plan: PlannedPull,
    region: SharedRegion,
    keys: Sequence[OffloadKey],
    slot_ids: Sequence[int],
    stop: float,
    config: P2PTierConfig,
) -> Pulled:
    """``keys`` (a prefix of the plan's) from the plan's peer into ``slot_ids``: over its
    direct stream if it offered one and it connects, else (or if it does not) over the bus."""
    if config.direct_transfer and plan.data_address:
        stream = StreamJob(
            plan.data_address, plan.session, 0, region, keys, slot_ids, stop, config.read_timeout_s
        )
        try:
            errors = await receive_stream(stream)
        except OSError as exc:  # no direct path to this peer: the bus carries the chunks
            log.info("p2p: no stream to %s (%s): reading over the bus", plan.data_address, exc)
        else:
            return Pulled(errors, sum(e is None for e in errors))
    job = PullJob(subjects.tier_peer_reads(plan.peer), plan.session, region, keys, slot_ids, stop)
    errors = await pull_run(
        bus, job, window=config.transfer_window, read_timeout_s=config.read_timeout_s
    )
    return Pulled(errors, 0)
