"""A folder of files as one object of an object store, so that a process on any host fetches it
by name with no shared filesystem (LoRA adapters pushed with ``shoal lora push``).

The object is a msgpack map of file name to bytes (the regular files at the folder's top level).
A fetch lands in ``cache_root/<name>-<digest>``: unpacked into a temporary sibling, renamed into
place when whole, so a reader never sees half a folder, a fetched copy is reused, and an object
put again under the same name lands in a new folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from pathlib import Path

import msgspec

from shoal.bus.buckets import ObjectStore

MAX_FILES = 64


class FolderFiles(msgspec.Struct, frozen=True):
    files: dict[str, bytes]


def pack_folder(folder: Path) -> bytes:
    """The regular files at ``folder``'s top level as one object."""
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    if not files:
        raise ValueError(f"{folder}: no files to push")
    if len(files) > MAX_FILES:
        raise ValueError(f"{folder}: {len(files)} files, more than {MAX_FILES}")
    return msgspec.msgpack.encode(FolderFiles(files))


def unpack_folder(data: bytes | bytearray, dest: Path) -> None:
    """Write an object's files into ``dest`` (which must not exist yet)."""
    files = msgspec.msgpack.decode(data, type=FolderFiles).files
    dest.mkdir(parents=True)
    for name, content in files.items():
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"object holds a file named {name!r}: not a plain file name")
        (dest / name).write_bytes(content)


async def put_folder(store: ObjectStore, name: str, folder: Path, *, writer: str = "") -> int:
    """Store ``folder`` as object ``name``; the bytes stored."""
    data = pack_folder(folder)
    await store.put(name, data, writer=writer)
    return len(data)


async def fetch_folder(
    store: ObjectStore, name: str, cache_root: Path, *, timeout: float = 60.0
) -> Path | None:
    """The local folder holding object ``name`` (fetched unless this version is there already);
    None when the store has no such object."""
    data = await store.get(name, timeout=timeout)
    if data is None:
        return None
    digest = hashlib.sha256(data).hexdigest()[:16]
    final = cache_root / f"{name}-{digest}"
    if final.is_dir():
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_root))
    try:
        unpack_folder(data, staging / "files")
        with contextlib.suppress(OSError):  # another process renamed its copy in first
            (staging / "files").rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
