"""What every secondary tier's stored chunk looks like, and the errors its reads and writes raise.

A stored part (a rank's bytes of a chunk, or a canonical chunk) is ``HEADER``, the key, then the
payload: magic ``SHKV``, format version, key length, payload length and the payload's xxh3-128
digest (about 12 GB/s here: crc32 is 2.6, blake2b 0.8). ``check_header`` refuses a part of
another format, key or length (``CorruptChunk``); the caller compares the digest once it has the
payload. ``DeadlinePassed`` is a job's slot left alone past its deadline (``check_deadline``).
"""

from __future__ import annotations

import struct
import time

import xxhash

from shoal.tiers.books.keys import OffloadKey

MAGIC = b"SHKV"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHQ16s")  # magic, version, key length, payload length, xxh3-128


class CorruptChunk(Exception):
    """A chunk whose parts are missing or do not hold what they claim (they are removed)."""

    def __init__(self, key: OffloadKey, reason: str) -> None:
        super().__init__(f"chunk {key.hex()}: {reason}")
        self.key = key
        self.reason = reason


class DeadlinePassed(Exception):
    """A job's deadline passed: its region slot may have been reused, so it was left alone (or
    what was read from it was discarded)."""


def check_deadline(key: OffloadKey, deadline: float) -> None:
    """``DeadlinePassed`` if ``deadline`` (``time.time()``; 0.0: none) is past."""
    if deadline and time.time() > deadline:
        raise DeadlinePassed(f"chunk {key.hex()}: deadline passed, its slot left alone")


def payload_digest(payload: memoryview | bytes) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def pack_head(key: OffloadKey, payload: memoryview | bytes) -> bytes:
    """``HEADER`` and the key: what goes before ``payload`` in a stored part."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, len(key), len(payload), payload_digest(payload)) + key


def head_size(key: OffloadKey) -> int:
    return HEADER.size + len(key)


def check_head(head: bytes | bytearray | memoryview, key: OffloadKey, length: int) -> bytes:
    """The payload digest a part's head (``head_size(key)`` bytes) promises, if it is a part of
    this format, for ``key``, of ``length`` payload bytes; else ``CorruptChunk``."""
    if len(head) < head_size(key):
        raise CorruptChunk(key, "truncated header")
    magic, version, key_len, num_bytes, digest = HEADER.unpack_from(head)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptChunk(key, f"not a version {FORMAT_VERSION} chunk")
    if key_len != len(key) or bytes(head[HEADER.size : HEADER.size + key_len]) != key:
        raise CorruptChunk(key, "holds another key")
    if num_bytes != length:
        raise CorruptChunk(key, f"not {length} payload bytes")
    return bytes(digest)
