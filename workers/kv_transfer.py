"""The worker side of the KV offload data plane: copies between this rank's paged KV cache
(``workers.kv_cache``) and a CPU tier's shared-memory region (``tiers.region``), as a step's
``KVTransfers`` says. No KV bytes travel on the bus.

``RegionViews`` maps a ``RegionRef`` (the file at ``ref.path``) as a tensor view of
``[num_slots, tp_size, num_layers, 2, blocks_per_chunk, block_size, num_kv_heads, head_dim]``
and keeps the two most recent generations mapped. ``run_kv_transfers`` validates every job
first, then runs the valid stores (KV → region) and then the valid loads (region → KV)
(``workers.kv_copy``: a pass per run of consecutive blocks, or a gather); a rank touches only its
own part of a slot (``[:, rank]``).

Validation depends only on the step and the region file, never on this rank's own history: a
region that cannot be mapped (file gone, wrong size) or whose layout is not this cache's fails
every job; a job with unequal lists or an id out of range fails alone. Ranks may still judge a
region differently (its file unlinked between two ranks' checks), so with tensor parallelism
the ranks then ``agree`` before any copy: a job fails if it fails on any rank, and every rank
skips the same jobs and drops the same requests (else their collectives would not match).

``DroppedLoads``: the requests the runner left out after a failed load, until the engine core
has seen the failure.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from shoal.bus.messages.offload import (
    KVLayout,
    KVLoad,
    KVStore,
    KVTransferResult,
    KVTransfers,
    RegionRef,
)
from shoal.workers.kv_cache import KVCache
from shoal.workers.kv_copy import CopyBatch, load_blocks, store_blocks

log = logging.getLogger(__name__)

MAX_DROPPED = 4096  # dropped ids kept while waiting for the engine core to let them go
KEEP_GENERATIONS = 2
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


class RegionUnavailable(OSError):
    """A region this worker cannot map (its file is gone or has the wrong size)."""


@dataclass(frozen=True)
class KVGeometry:
    """This rank's KV cache shape, as a ``KVLayout`` must match it."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tp_size: int

    @classmethod
    def of(cls, kv_cache: KVCache, tp_size: int) -> KVGeometry:
        _, block_size, num_kv_heads, head_dim = kv_cache.k[0].shape
        return cls(
            len(kv_cache.k),
            block_size,
            num_kv_heads,
            head_dim,
            dtype_name(kv_cache.k[0].dtype),
            tp_size,
        )

    def mismatch(self, layout: KVLayout) -> str | None:
        """Why ``layout`` cannot be copied to or from this cache (None: it can)."""
        differ = [
            f"{name} {getattr(layout, name)} != {mine}"
            for name, mine in vars(self).items()
            if getattr(layout, name) != mine
        ]
        return "; ".join(differ) or None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the spelling of ``KVLayout.dtype``)."""
    return DTYPE_NAMES[dtype]


@dataclass
class _Mapped:
    ref: RegionRef
    identity: tuple[int, int]  # (st_dev, st_ino) of the file mapped
    mapping: mmap.mmap
    view: torch.Tensor  # [S, tp, L, 2, C, block_size, H, D], over ``mapping``


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
        """The region as ``[num_slots, tp_size, num_layers, 2, blocks_per_chunk, block_size,
        num_kv_heads, head_dim]``; raises ``RegionUnavailable``."""
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
        shape = (
            *(ref.num_slots, layout.tp_size, layout.num_layers, 2, layout.blocks_per_chunk),
            *(layout.block_size, layout.num_kv_heads, layout.head_dim),
        )
        with torch.inference_mode(False):  # a plain tensor, writable inside and outside
            view = torch.frombuffer(mapping, dtype=TORCH_DTYPES[layout.dtype]).view(shape)
        return _Mapped(ref, (stat.st_dev, stat.st_ino), mapping, view)


Agree = Callable[[list[bool]], list[bool]]
"""Per-job failure flags of this rank → those of every rank (a flag set on any rank is set)."""


def job_fault(
    block_ids: Sequence[int],
    slot_ids: Sequence[int],
    block_offsets: Sequence[int],
    *,
    num_blocks: int,
    num_slots: int,
    blocks_per_chunk: int,
) -> str | None:
    """Why one load or store job cannot run (None: it can). Block 0 is the null block."""
    num = len(block_ids)
    if len(slot_ids) != num or len(block_offsets) != num:
        return f"{num} block ids, {len(slot_ids)} slot ids, {len(block_offsets)} offsets"
    if num == 0:
        return None
    for what, ids, low, high in (
        ("block id", block_ids, 1, num_blocks),
        ("slot id", slot_ids, 0, num_slots),
        ("block offset", block_offsets, 0, blocks_per_chunk),
    ):
        if min(ids) < low or max(ids) >= high:
            bad = next(i for i in ids if not low <= i < high)
            return f"{what} {bad} is outside [{low}, {high})"
    return None


def _job_failures(
    jobs: Sequence[KVLoad | KVStore], ref: RegionRef, num_blocks: int, failure: str | None
) -> list[bool]:
    """Whether each job fails on this rank (every one when the region has a ``failure``)."""
    if failure is not None:
        return [True] * len(jobs)
    failed = []
    for job in jobs:
        fault = job_fault(
            job.block_ids,
            job.slot_ids,
            job.block_offsets,
            num_blocks=num_blocks,
            num_slots=ref.num_slots,
            blocks_per_chunk=ref.layout.blocks_per_chunk,
        )
        if fault is not None:
            log.warning("KV %s fails: %s", _job_name(job), fault)
        failed.append(fault is not None)
    return failed


def _job_name(job: KVLoad | KVStore) -> str:
    return f"load of {job.req_id}" if isinstance(job, KVLoad) else f"store job {job.job_id}"


def _batch(jobs: Sequence[KVLoad | KVStore], failed: Sequence[bool]) -> CopyBatch:
    """The jobs that did not fail, flattened."""
    batch = CopyBatch([], [], [])
    for job, fails in zip(jobs, failed, strict=True):
        if not fails:
            batch.block_ids += job.block_ids
            batch.slot_ids += job.slot_ids
            batch.block_offsets += job.block_offsets
    return batch


def run_kv_transfers(
    transfers: KVTransfers,
    kv_cache: KVCache,
    *,
    tp_rank: int,
    tp_size: int,
    regions: RegionViews,
    agree: Agree | None = None,
) -> KVTransferResult:
    """Validate ``transfers``, then run its valid stores, then its valid loads (this rank's
    part of each slot only). With ``agree`` (tensor parallelism), a job runs only if it is
    valid on every rank: called once, with the loads' flags then the stores', when the step
    has any job. Never raises for a bad job or region: the result names what failed, with
    the bytes this rank moved and the seconds it took."""
    ref = transfers.region
    loads, stores = transfers.loads, transfers.stores
    failure = KVGeometry.of(kv_cache, tp_size).mismatch(ref.layout)
    if failure is not None:
        failure = f"region layout is not this worker's KV cache: {failure}"
    view = None
    if failure is None and (loads or stores):
        try:
            view = regions.view(ref)
        except RegionUnavailable as exc:
            failure = str(exc)
    if failure is not None and (loads or stores):
        log.warning("every KV copy of the step fails: %s", failure)
    mine = [
        *_job_failures(loads, ref, kv_cache.num_blocks, failure),
        *_job_failures(stores, ref, kv_cache.num_blocks, failure),
    ]
    failed = agree(mine) if agree is not None and mine else mine
    jobs: list[KVLoad | KVStore] = [*loads, *stores]
    for job, here, anywhere in zip(jobs, mine, failed, strict=True):
        if anywhere and not here:
            log.warning("KV %s fails on another tensor-parallel rank", _job_name(job))
    failed_loads, failed_stores = failed[: len(loads)], failed[len(loads) :]
    failed_req_ids = [j.req_id for j, f in zip(loads, failed_loads, strict=True) if f]
    result = KVTransferResult(
        failed_load_req_ids=list(dict.fromkeys(failed_req_ids)),
        failed_store_job_ids=[j.job_id for j, f in zip(stores, failed_stores, strict=True) if f],
    )
    if view is None:
        return result
    _copy(
        result,
        view[:, tp_rank],
        kv_cache,
        _batch(stores, failed_stores),
        _batch(loads, failed_loads),
        ref.layout.rank_block_bytes,
    )
    return result


def _copy(
    result: KVTransferResult,
    rank_view: torch.Tensor,
    kv_cache: KVCache,
    stores: CopyBatch,
    loads: CopyBatch,
    block_bytes: int,
) -> None:
    """Run the stores, then the loads; record their bytes and seconds in ``result``."""
    started = time.perf_counter()
    if stores.block_ids:
        store_blocks(rank_view, kv_cache, stores)
        result.num_store_bytes = len(stores.block_ids) * block_bytes
    loaded = time.perf_counter()
    if loads.block_ids:
        load_blocks(rank_view, kv_cache, loads)
        result.num_load_bytes = len(loads.block_ids) * block_bytes
    result.store_time_s = loaded - started
    result.load_time_s = time.perf_counter() - loaded


class DroppedLoads:
    """Requests out of the persistent batch because their KV load failed. A step naming one
    as cached leaves it out (sent before the engine core saw the failure); the engine core
    lets it go by finishing, preempting or re-sending it as new (it is recomputed)."""

    def __init__(self) -> None:
        self._req_ids: dict[str, None] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._req_ids

    def __len__(self) -> int:
        return len(self._req_ids)

    def add(self, req_id: str) -> None:
        if len(self._req_ids) >= MAX_DROPPED:
            del self._req_ids[next(iter(self._req_ids))]
        self._req_ids[req_id] = None

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._req_ids.pop(req_id, None)

    def clear(self) -> None:
        self._req_ids.clear()
