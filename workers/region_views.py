"""The CPU tier regions a worker maps for its KV copies: ``RegionViews`` maps a ``RegionRef`` (the
file at ``ref.path``) as a tensor of ``[num_slots, *slot_shape(layout)]`` and keeps the most
recently used generations mapped, checking the file again at every use.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from shoal.bus.messages.offload import KVLayout, RegionRef

KEEP_GENERATIONS = 2
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class RegionUnavailable(OSError):
    """A region this worker cannot map (its file is gone or has the wrong size)."""


@dataclass
class _Mapped:
    ref: RegionRef
    identity: tuple[int, int]  # (st_dev, st_ino) of the file mapped
    mapping: mmap.mmap
    view: torch.Tensor  # [S, *slot_shape(ref.layout)], over ``mapping``


class RegionViews:
    """Region files mapped as tensors, the ``keep`` most recently used generations at most.

    Each use checks the file again (one ``stat``): a file that is gone, resized or replaced is
    never read through an old mapping (ranks that still judge it differently agree before any
    copy: ``run_kv_transfers``)."""

    def __init__(self, keep: int = KEEP_GENERATIONS) -> None:
        self.keep = keep
        self._mapped: OrderedDict[tuple[str, str], _Mapped] = OrderedDict()

    def __len__(self) -> int:
        return len(self._mapped)

    def view(self, ref: RegionRef) -> torch.Tensor:
        """The region as ``[num_slots, *slot_shape(ref.layout)]``; raises
        ``RegionUnavailable``."""
        key = (ref.path, ref.generation)
        size = ref.num_slots * ref.layout.slot_bytes
        try:
            stat = os.stat(ref.path)
        except OSError as exc:
            self._mapped.pop(key, None)
            raise RegionUnavailable(f"region {ref.path} cannot be opened: {exc}") from exc
        if stat.st_size != size or size == 0:
            self._mapped.pop(key, None)
            raise RegionUnavailable(f"region {ref.path} is {stat.st_size} bytes, not {size}")
        mapped = self._mapped.get(key)
        if mapped is None or mapped.ref != ref or mapped.identity != (stat.st_dev, stat.st_ino):
            mapped = self._map(ref, size)
            self._mapped[key] = mapped
        self._mapped.move_to_end(key)
        while len(self._mapped) > self.keep:
            self._mapped.popitem(last=False)  # the mapping closes with its last view
        return mapped.view

    @staticmethod
    def _map(ref: RegionRef, size: int) -> _Mapped:
        try:
            fd = os.open(ref.path, os.O_RDWR)
        except OSError as exc:
            raise RegionUnavailable(f"region {ref.path} cannot be opened: {exc}") from exc
        try:
            stat = os.fstat(fd)
            if stat.st_size != size:
                raise RegionUnavailable(f"region {ref.path} is {stat.st_size} bytes, not {size}")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        layout = ref.layout
        with torch.inference_mode(False):  # a plain tensor, writable inside and outside
            view = torch.frombuffer(mapping, dtype=TORCH_DTYPES[layout.dtype])
            view = view.view(ref.num_slots, *slot_shape(layout))
        return _Mapped(ref, (stat.st_dev, stat.st_ino), mapping, view)


def slot_shape(layout: KVLayout) -> tuple[int, ...]:
    """One slot as a tensor: ``[tp_size, L, 2, C, block_size, H, D]``, or, canonical,
    ``[L, 2, C, H, block_size, D]``."""
    per_layer = (layout.num_layers, 2, layout.blocks_per_chunk)
    if layout.canonical:
        return (*per_layer, layout.num_kv_heads, layout.block_size, layout.head_dim)
    return (layout.tp_size, *per_layer, layout.block_size, layout.num_kv_heads, layout.head_dim)
