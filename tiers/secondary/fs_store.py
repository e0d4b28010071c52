"""The filesystem tier's chunk files: one file per tensor-parallel rank part of a chunk.

Path: ``<root>/<model dir>/<part dir>/<2 hex>/<key hex>.bin``; the model dir is the layout's
``model_tag`` made safe as one directory name (``model_dir_name``), the part dir
``tp<tp_size>_r<rank>``, or ``canonical`` for the one part of a canonical layout (the same
whatever tensor-parallel size wrote it: ``part_dir_name``). Layouts with another tag or
tensor-parallel size never share a file; two layouts that share a tag and a size but not a
chunk size would find each other's files the wrong length (corrupt, removed), so a ``model_tag``
must name the KV format too.

A file is a header, the key, then the payload (the rank's ``rank_chunk_bytes`` of a region slot),
as ``tiers.secondary.chunk_format`` lays out every secondary tier's parts (an xxh3-128 digest of the
payload). Writes are atomic: a unique temp file in the same directory, then ``os.replace``; there
is no fsync (this is a cache: a file torn by a crash fails its length or digest and is treated as a
miss). A read that finds a missing part, another magic, version, key or length, or a wrong digest
raises ``CorruptChunk`` and removes every part of that chunk. A write or read given a ``deadline``
(a ``time.time()`` instant after which the region slot may be reused) touches no slot past it, and
a write publishes nothing read from the slot once it has passed (``DeadlinePassed``). A write and a
successful read set the parts' mtime (the caller may give the stamp: a request's tail a little
older than its head, as its LRU index has them), so ``scan`` after a restart orders chunks by last
use.

Blocking file I/O only, safe to call from several threads for different keys: the tier actor runs
it off its event loop. One actor owns a directory: ``scan`` removes every temp file it finds.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from shoal.bus.messages.offload import KVLayout
from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.secondary.chunk_format import (
    CorruptChunk,
    DeadlinePassed,
    check_deadline,
    check_head,
    head_size,
    pack_head,
    payload_digest,
)

__all__ = ["TMP_SUFFIX", "ChunkFiles", "CorruptChunk", "DeadlinePassed", "check_deadline"]

SUFFIX = ".bin"
TMP_SUFFIX = ".tmp"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_DIR_NAME = 100


def model_dir_name(model_tag: str) -> str:
    """``model_tag`` as one safe directory name; a tag that had to change gets a short digest
    of the original, so two tags never share a directory."""
    safe = _UNSAFE.sub("_", model_tag).lstrip(".")[:_MAX_DIR_NAME]
    if safe and safe == model_tag:
        return safe
    return f"{safe or 'model'}-{xxhash.xxh3_64_hexdigest(model_tag.encode())[:8]}"


def part_dir_name(layout: KVLayout, rank: int) -> str:
    """The directory (or object name part) of a chunk's part ``rank``: ``tp<size>_r<rank>``, or
    ``canonical`` (a canonical layout's one part, independent of the tensor-parallel size)."""
    return "canonical" if layout.canonical else f"tp{layout.tp_size}_r{rank}"


@dataclass(slots=True)
class ScanResult:
    """Complete chunks on disk (every rank part), least recently used first, and what was
    cleaned: leftover temp files and the parts of incomplete chunks."""

    keys: list[OffloadKey] = field(default_factory=list)
    num_temp_removed: int = 0
    num_partial_removed: int = 0


class ChunkFiles:
    """The chunk files of one layout under ``root``."""

    def __init__(self, root: str | os.PathLike[str], layout: KVLayout) -> None:
        self.layout = layout
        self.model_dir = Path(root) / model_dir_name(layout.model_tag)
        self.rank_dirs = [self.model_dir / part_dir_name(layout, r) for r in range(layout.tp_size)]

    def path(self, key: OffloadKey, rank: int) -> Path:
        name = key.hex()
        return self.rank_dirs[rank] / name[:2] / f"{name}{SUFFIX}"

    def rank_part(self, slot: memoryview, rank: int) -> memoryview:
        """Part ``rank``'s bytes of a region slot (``[tp_rank][layer][k|v][block][...]``; a
        canonical slot is one part)."""
        size = self.layout.rank_chunk_bytes
        return slot[rank * size : (rank + 1) * size]

    # -- writes ---------------------------------------------------------------------------------

    def write_chunk(
        self,
        key: OffloadKey,
        slot: memoryview,
        stamp_ns: int | None = None,
        deadline: float = 0.0,
    ) -> None:
        """Write every rank part of a slot (with mtime ``stamp_ns``, else now) to temp files,
        then publish them all; on an error no part of the chunk is left. Past ``deadline``
        (``time.time()``; 0.0: none) before the slot is read, or after it is read and before
        anything is published, ``DeadlinePassed``."""
        self._check_slot(slot)
        check_deadline(key, deadline)
        temps: list[Path] = []
        try:
            for rank in range(self.layout.tp_size):
                temps.append(self._write_temp(key, rank, self.rank_part(slot, rank), stamp_ns))
            check_deadline(key, deadline)  # the slot may have been reused while it was read
            for rank, tmp in enumerate(temps):
                os.replace(tmp, self.path(key, rank))
        except BaseException:
            for tmp in temps:
                tmp.unlink(missing_ok=True)
            self.delete(key)
            raise

    def write_part(
        self, key: OffloadKey, rank: int, payload: memoryview, stamp_ns: int | None = None
    ) -> None:
        tmp = self._write_temp(key, rank, payload, stamp_ns)
        try:
            os.replace(tmp, self.path(key, rank))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _write_temp(
        self, key: OffloadKey, rank: int, payload: memoryview, stamp_ns: int | None
    ) -> Path:
        """A unique temp file beside the part's path holding it; the caller publishes it."""
        path = self.path(key, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        head = pack_head(key, payload)
        tmp = path.with_name(f".{path.stem}.{secrets.token_hex(6)}{TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
                if stamp_ns is not None:
                    f.flush()
                    os.utime(f.fileno(), ns=(stamp_ns, stamp_ns))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    # -- reads ----------------------------------------------------------------------------------

    def read_chunk(
        self,
        key: OffloadKey,
        slot: memoryview,
        stamp_ns: int | None = None,
        deadline: float = 0.0,
    ) -> None:
        """Read every rank part into a slot, then set their mtime to ``stamp_ns`` (else now);
        ``CorruptChunk`` (and the chunk's files removed) if any part is missing or wrong;
        ``DeadlinePassed`` (the slot untouched) if ``deadline`` (0.0: none) is past."""
        self._check_slot(slot)
        check_deadline(key, deadline)
        try:
            for rank in range(self.layout.tp_size):
                self.read_part(key, rank, self.rank_part(slot, rank))
        except CorruptChunk:
            self.delete(key)
            raise
        stamp_ns = time.time_ns() if stamp_ns is None else stamp_ns
        for rank in range(self.layout.tp_size):
            with contextlib.suppress(OSError):  # recency only; the bytes were read
                os.utime(self.path(key, rank), ns=(stamp_ns, stamp_ns))

    def read_part(self, key: OffloadKey, rank: int, target: memoryview) -> None:
        path = self.path(key, rank)
        try:
            with open(path, "rb", buffering=0) as f:
                self._read_verified(f, key, target)
        except FileNotFoundError:
            raise CorruptChunk(key, f"part {rank} is missing") from None
        except CorruptChunk as exc:
            raise CorruptChunk(key, f"part {rank}: {exc.reason}") from None

    def _read_verified(self, f: io.FileIO, key: OffloadKey, target: memoryview) -> None:
        head = bytearray(head_size(key))
        if _read_full(f, memoryview(head)) != len(head):
            raise CorruptChunk(key, "truncated header")
        digest = check_head(head, key, len(target))
        length = len(target)
        if os.fstat(f.fileno()).st_size != len(head) + length:
            raise CorruptChunk(key, f"not {length} payload bytes")
        if _read_full(f, target) != length:
            raise CorruptChunk(key, "truncated payload")
        if payload_digest(target) != digest:
            raise CorruptChunk(key, "checksum mismatch")

    # -- removal and discovery ------------------------------------------------------------------

    def delete(self, key: OffloadKey) -> bool:
        """Remove every rank part of a chunk; whether any was there."""
        found = False
        for rank in range(self.layout.tp_size):
            try:
                self.path(key, rank).unlink()
                found = True
            except FileNotFoundError:
                pass
        return found

    def scan(self) -> ScanResult:
        """The complete chunks on disk, least recently used (oldest mtime) first; removes temp
        files and the parts of chunks that miss a rank."""
        result = ScanResult()
        mtimes: dict[str, list[int]] = {}
        for rank_dir in self.rank_dirs:
            for entry in _files_below(rank_dir):
                if entry.name.endswith(TMP_SUFFIX):
                    Path(entry.path).unlink(missing_ok=True)
                    result.num_temp_removed += 1
                elif entry.name.endswith(SUFFIX) and is_key_hex(name := entry.name[: -len(SUFFIX)]):
                    mtimes.setdefault(name, []).append(entry.stat().st_mtime_ns)
        found = []
        for name, times in mtimes.items():
            if len(times) == self.layout.tp_size:
                found.append((max(times), name))
            else:
                self.delete(bytes.fromhex(name))
                result.num_partial_removed += len(times)
        result.keys = [bytes.fromhex(name) for _, name in sorted(found)]
        return result

    def _check_slot(self, slot: memoryview) -> None:
        if len(slot) != self.layout.slot_bytes:
            raise ValueError(f"a slot of this layout is {self.layout.slot_bytes} bytes")


def _read_full(f: io.FileIO, target: memoryview) -> int:
    """``readinto`` until ``target`` is full or the file ends; the bytes read."""
    num_read = 0
    while num_read < len(target):
        n = f.readinto(target[num_read:])
        if not n:
            break
        num_read += n
    return num_read


def _files_below(rank_dir: Path) -> list[os.DirEntry[str]]:
    """The files one level of subdirectories below ``rank_dir`` (none if it is missing)."""
    if not rank_dir.is_dir():
        return []
    files: list[os.DirEntry[str]] = []
    with os.scandir(rank_dir) as subdirs:
        for sub in subdirs:
            if sub.is_dir(follow_symlinks=False):
                with os.scandir(sub.path) as entries:
                    files.extend(e for e in entries if e.is_file(follow_symlinks=False))
    return files


def is_key_hex(name: str) -> bool:
    """Whether a file or object name is a chunk key in lower-case hex."""
    return len(name) % 2 == 0 and bool(name) and all(c in "0123456789abcdef" for c in name)
