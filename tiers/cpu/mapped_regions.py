"""The CPU tier regions a secondary tier maps (``tiers.cpu.region.SharedRegion.attach``): the latest
few generations stay mapped; an older one is unmapped once no job uses it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from shoal.bus.messages.offload import RegionRef
from shoal.tiers.cpu.region import SharedRegion


class MappedRegions:
    """The CPU tier's regions this actor has mapped: the latest ``keep`` stay mapped, an older
    one is unmapped once no job uses it (a restarted CPU tier makes a new generation)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._regions: dict[tuple[str, str], SharedRegion] = {}  # oldest first
        self._users: dict[tuple[str, str], int] = {}

    @contextmanager
    def use(self, ref: RegionRef) -> Iterator[SharedRegion]:
        """The mapped region (mapped now if new); ``OSError`` if it cannot be mapped."""
        name = (ref.path, ref.generation)
        region = self._regions.get(name)
        if region is None:
            region = self._regions[name] = SharedRegion.attach(ref)
        self._users[name] = self._users.get(name, 0) + 1
        try:
            yield region
        finally:
            self._users[name] -= 1
            self._unmap_old()

    def _unmap_old(self) -> None:
        for name in list(self._regions)[: -self.keep]:
            if not self._users.get(name):
                self._close(name)

    def _close(self, name: tuple[str, str]) -> None:
        try:
            self._regions[name].close()
        except BufferError:
            return  # a slot view is still alive somewhere: try again later
        del self._regions[name]
        self._users.pop(name, None)

    @property
    def num_mapped(self) -> int:
        return len(self._regions)

    def close(self) -> None:
        for name in list(self._regions):
            self._close(name)
