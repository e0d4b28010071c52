"""Which adapter sits in which of a worker's fixed LoRA slots (pure; least recently used out).

A step names the adapters it needs (at most one per slot: the scheduler admits no more); those
already resident stay where they are, the others take a free slot or the least recently used
slot of an adapter the step does not need.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))  # slot 0 handed out first
        self.num_evictions = 0

    def place(self, adapter_ids: Iterable[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for these adapters, marked most recently used: (id -> slot, and the (id, slot)
        pairs whose weights must be written now). Raises ValueError for more adapters than
        slots."""
        wanted = list(dict.fromkeys(adapter_ids))
        if len(wanted) > self.num_slots:
            raise ValueError(
                f"a step needs {len(wanted)} adapters but a worker has {self.num_slots} LoRA "
                "slots (max_loras)"
            )
        placement: dict[int, int] = {}
        for adapter_id in wanted:
            if adapter_id in self._slot_of:
                self._slot_of.move_to_end(adapter_id)
                placement[adapter_id] = self._slot_of[adapter_id]
        loads: list[tuple[int, int]] = []
        for adapter_id in wanted:
            if adapter_id in placement:
                continue
            slot = self._free.pop() if self._free else self._evict_unneeded(placement)
            self._slot_of[adapter_id] = slot
            placement[adapter_id] = slot
            loads.append((adapter_id, slot))
        return placement, loads

    def _evict_unneeded(self, placement: dict[int, int]) -> int:
        for adapter_id in self._slot_of:  # least recently used first
            if adapter_id not in placement:
                self.num_evictions += 1
                return self._slot_of.pop(adapter_id)
        raise AssertionError("no slot to evict (more adapters than slots)")

    def remove(self, adapter_id: int) -> int | None:
        """Free the adapter's slot (unloaded); its slot, or None if it had none."""
        slot = self._slot_of.pop(adapter_id, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def slot_of(self, adapter_id: int) -> int | None:
        return self._slot_of.get(adapter_id)

    @property
    def resident(self) -> list[int]:
        """Resident adapters, least recently used first."""
        return list(self._slot_of)
