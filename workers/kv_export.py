"""A worker's paged KV cache in shared memory, for remote decodes to pull (disaggregated
prefill, ``bus.messages.kv_handover``).

Exporting (``ExportedKVCache.allocate``): the cache lives in one anonymous shared-memory file
(``memfd``: freed with the last process that maps it, so a killed worker leaks nothing) as
``[layer][k|v][block][block_size, kv_head, head_dim]`` after a one-page header (magic, a random
token, the epoch), each layer's K and V a contiguous ``KVCache`` page tensor as before. Other
processes of the host open it as ``/proc/<pid>/fd/<fd>``. ``advance_epoch`` (the worker forgot
its requests) makes every pull of KV held before it fail.

Reading (``ExportViews.map``): another worker's file mapped as a tensor ``[L, 2, B, block_size,
H, D]`` with its epoch, refused unless it is the file the ref names (size, magic and token).
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal.bus.messages.kv_handover import KVExportRef
from shoal.workers.kv_cache import KVCache
from shoal.workers.region_views import TORCH_DTYPES

HEADER_BYTES = 4096
MAGIC = b"SHOALKV1"
_HEADER = struct.Struct("<8s16sQ")  # magic, token, epoch
_EPOCH_OFFSET = 24
KEEP_MAPPED = 8  # other workers' caches kept mapped at once
# The exporting worker's own cache: shared, and populated at once. A shared-memory page written
# for the first time costs a fault several times the copy of its bytes (a pull into untouched
# blocks ran at ~1 GB/s, ~7 GB/s once touched), so the cache pays it at start, not in a step.
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class ExportUnavailable(OSError):
    """A remote KV cache this worker cannot read (gone, another host, not what the ref says)."""


def host_identity() -> str:
    """Who can open this host's exported files: the kernel's boot id and the host name."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return f"{boot_id}:{socket.gethostname()}"


def _data_shape(num_layers: int, num_blocks: int, page: tuple[int, int, int]) -> tuple[int, ...]:
    return (num_layers, 2, num_blocks, *page)


@dataclass
class ExportedKVCache:
    """This worker's cache in a shared file: the ``KVCache`` over it and the file itself."""

    kv_cache: KVCache
    fd: int
    mapping: mmap.mmap
    token: bytes
    epoch: int = 0

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> ExportedKVCache:
        page = (block_size, num_kv_heads, head_dim)
        shape = _data_shape(num_layers, num_blocks, page)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        data_bytes = itemsize * num_layers * 2 * num_blocks * block_size * num_kv_heads * head_dim
        fd = os.memfd_create("shoal-kv-cache")
        try:
            os.ftruncate(fd, HEADER_BYTES + data_bytes)
            mapping = mmap.mmap(fd, HEADER_BYTES + data_bytes, flags=MAP_FLAGS)
        except OSError:
            os.close(fd)
            raise
        token = secrets.token_bytes(16)
        _HEADER.pack_into(mapping, 0, MAGIC, token, 0)
        with torch.inference_mode(False):  # plain tensors, written inside and outside
            data = torch.frombuffer(mapping, dtype=dtype, offset=HEADER_BYTES).view(shape)
        kv_cache = KVCache(
            k=[data[layer, 0] for layer in range(num_layers)],
            v=[data[layer, 1] for layer in range(num_layers)],
            num_blocks=num_blocks,
            block_size=block_size,
        )
        return cls(kv_cache, fd, mapping, token)

    def ref(
        self, *, tp_rank: int, tp_size: int, total_kv_heads: int, dtype: str, address: str = ""
    ) -> KVExportRef:
        """What a remote decode's workers need to find and read this cache (``address``: its
        server's, for readers on other hosts)."""
        num_blocks, block_size, num_kv_heads, head_dim = self.kv_cache.k[0].shape
        return KVExportRef(
            host=host_identity(),
            path=f"/proc/{os.getpid()}/fd/{self.fd}",
            token=self.token.hex(),
            epoch=self.epoch,
            num_blocks=num_blocks,
            num_layers=len(self.kv_cache.k),
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_kv_heads=total_kv_heads,
            address=address,
        )

    def advance_epoch(self) -> None:
        """The worker forgot its requests: KV held for remote decodes before now is void."""
        self.epoch += 1
        struct.pack_into("<Q", self.mapping, _EPOCH_OFFSET, self.epoch)


def allocate_kv_cache(
    *, exported: bool, device: torch.device, **shape: Any
) -> tuple[ExportedKVCache | None, KVCache]:
    """A worker's KV cache of ``shape`` (``KVCache.allocate``'s geometry): exported (on the CPU,
    for remote decodes to pull), or plain on ``device``."""
    if exported:
        export = ExportedKVCache.allocate(**shape)
        return export, export.kv_cache
    return None, KVCache.allocate(**shape, device=device)


@dataclass
class MappedExport:
    """Another worker's exported cache, mapped: readable for as long as this is held."""

    mapping: mmap.mmap
    view: torch.Tensor  # [L, 2, B, block_size, H, D]

    def epoch(self) -> int:
        """The exporting worker's epoch now."""
        return int(struct.unpack_from("<Q", self.mapping, _EPOCH_OFFSET)[0])


class ExportViews:
    """Other workers' exported caches, mapped (the ``keep`` most recently used)."""

    def __init__(self, keep: int = KEEP_MAPPED) -> None:
        self.keep = keep
        self.host = host_identity()
        self._mapped: OrderedDict[tuple[str, str], MappedExport] = OrderedDict()

    def map(self, ref: KVExportRef) -> MappedExport:
        """The cache ``ref`` names, mapped (``view``: ``[L, 2, B, block_size, H, D]``);
        ``ExportUnavailable`` if it is on another host, gone or not the file ``ref`` names."""
        if ref.host != self.host:
            raise ExportUnavailable(f"KV cache of rank {ref.tp_rank} is on another host")
        key = (ref.path, ref.token)
        mapped = self._mapped.get(key)
        if mapped is None:
            mapped = self._map(ref)
            self._mapped[key] = mapped
            while len(self._mapped) > self.keep:
                self._mapped.popitem(last=False)  # (still readable through handles held)
        self._mapped.move_to_end(key)
        return mapped

    @staticmethod
    def _map(ref: KVExportRef) -> MappedExport:
        dtype = TORCH_DTYPES.get(ref.dtype)
        if dtype is None:
            raise ExportUnavailable(f"KV dtype {ref.dtype!r} is not one shoal exports")
        page = (ref.block_size, ref.num_kv_heads, ref.head_dim)
        shape = _data_shape(ref.num_layers, ref.num_blocks, page)
        size = HEADER_BYTES + torch.empty(0, dtype=dtype).element_size() * int(
            torch.Size(shape).numel()
        )
        try:
            fd = os.open(ref.path, os.O_RDWR)
        except OSError as exc:
            raise ExportUnavailable(f"KV cache {ref.path} cannot be opened: {exc}") from exc
        try:
            if os.fstat(fd).st_size != size:
                raise ExportUnavailable(f"KV cache {ref.path} is not {size} bytes")
            mapping = mmap.mmap(fd, size)  # (not populated: a read maps only the pages it reads)
        finally:
            os.close(fd)
        magic, token, _ = _HEADER.unpack_from(mapping, 0)
        if magic != MAGIC or token.hex() != ref.token:
            mapping.close()
            raise ExportUnavailable(f"{ref.path} is not the KV cache the ref names")
        with torch.inference_mode(False):
            view = torch.frombuffer(mapping, dtype=dtype, offset=HEADER_BYTES).view(shape)
        return MappedExport(mapping, view)
