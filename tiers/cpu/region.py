"""A CPU tier's shared-memory region: one file in ``/dev/shm`` (or the temp directory where there
is none), ``num_slots * layout.slot_bytes`` bytes, mapped by the tier, by the workers of engine
cores on the host (``workers.kv_transfer``) and by secondary tiers on the host.

The file is named after the namespace, the tier id and the tier's incarnation (the region's
``generation``, which starts with its process id), so a restarted tier makes a new, empty region
and removes what an earlier incarnation left behind (a SIGKILLed tier cannot unlink its own),
but never the region of a live process. Nothing writes an old region
any more; a worker checks that the file is still there before each use, so copies still naming
an old region fail (their requests recompute) once the new tier has removed it.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

from shoal.bus.messages.offload import KVLayout, RegionRef

SUFFIX = ".kv"


def region_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def region_prefix(namespace: str, tier_id: str) -> str:
    return f"shoal-{namespace.replace('.', '-')}-{tier_id}-"


def _owner_alive(generation: str) -> bool:
    """Whether the tier that made a region is another live process: a generation starts with
    its process id (``bus.runtime.actor.new_incarnation``). Another deployment on this host sharing
    the namespace and tier id (two offline ``LLM`` instances, say) keeps its region."""
    pid_text = generation.split("-", 1)[0]
    if not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedRegion:
    """The tier's own mapping of its region (read and write)."""

    def __init__(self, ref: RegionRef, mapping: mmap.mmap) -> None:
        self.ref = ref
        self._mmap = mapping
        self.view = memoryview(mapping)

    @classmethod
    def create(
        cls,
        namespace: str,
        tier_id: str,
        generation: str,
        num_slots: int,
        layout: KVLayout,
        directory: Path | None = None,
    ) -> SharedRegion:
        """A new zero-filled region; earlier regions of this tier in ``directory`` are removed."""
        if num_slots < 1:
            raise ValueError(f"a region needs at least one slot, got {num_slots}")
        directory = directory or region_dir()
        prefix = region_prefix(namespace, tier_id)
        for stale in directory.glob(f"{prefix}*{SUFFIX}"):
            if not _owner_alive(stale.name[len(prefix) : -len(SUFFIX)]):
                stale.unlink(missing_ok=True)
        path = directory / f"{prefix}{generation}{SUFFIX}"
        size = num_slots * layout.slot_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(RegionRef(str(path), generation, num_slots, layout), mapping)

    @classmethod
    def attach(cls, ref: RegionRef) -> SharedRegion:
        """Map an existing region (a secondary tier on the same host); ``OSError`` if gone."""
        size = ref.num_slots * ref.layout.slot_bytes
        fd = os.open(ref.path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise OSError(f"region {ref.path} is not {size} bytes")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(ref, mapping)

    def slot(self, slot_id: int) -> memoryview:
        """The bytes of one slot (all ranks)."""
        if not 0 <= slot_id < self.ref.num_slots:
            raise IndexError(f"slot {slot_id} is outside the region's {self.ref.num_slots}")
        size = self.ref.layout.slot_bytes
        return self.view[slot_id * size : (slot_id + 1) * size]

    def close(self, unlink: bool = False) -> None:
        self.view.release()
        self._mmap.close()
        if unlink:
            Path(self.ref.path).unlink(missing_ok=True)
