"""The worker side of the KV offload data plane: copies between this rank's paged KV cache
(``workers.kv_cache``) and a CPU tier's shared-memory region (``tiers.cpu.region``), as a step's
``KVTransfers`` says. No KV bytes travel on the bus.

``run_kv_transfers`` validates every job first, then runs the valid stores (KV → region) and
then the valid loads (region → KV) (``workers.kv_copy``: a pass per run of consecutive blocks,
or a gather) through the region's view (``workers.region_views``). A rank touches only its own
part of a slot (``[:, rank]``) or, canonical, its own heads (``workers.kv_canonical``), storing
only the chunks it is the writer of when other ranks hold the same heads.

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
import time
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
from shoal.workers.kv_canonical import CanonicalMapping, local_kv_heads
from shoal.workers.kv_copy import CopyBatch, canonical_part, load_blocks, store_blocks
from shoal.workers.region_views import TORCH_DTYPES, RegionUnavailable, RegionViews

__all__ = [
    "DroppedLoads",
    "KVGeometry",
    "RegionUnavailable",
    "RegionViews",
    "dtype_name",
    "job_fault",
    "run_kv_transfers",
]

log = logging.getLogger(__name__)

MAX_DROPPED = 4096  # dropped ids kept while waiting for the engine core to let them go
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


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
        """Why ``layout`` cannot be copied to or from this cache (None: it can). A canonical
        layout names the model's KV heads, one part: this rank's heads must be its share."""
        mine = vars(self)
        if layout.canonical:
            try:
                num_heads = local_kv_heads(layout.num_kv_heads, self.tp_size)
            except ValueError as exc:
                return f"canonical num_kv_heads: {exc}"
            if num_heads != self.num_kv_heads:
                return (
                    f"canonical num_kv_heads {layout.num_kv_heads} over {self.tp_size} ranks is "
                    f"{num_heads} per rank != {self.num_kv_heads}"
                )
            mine = {**mine, "num_kv_heads": layout.num_kv_heads, "tp_size": 1}
        differ = [
            f"{name} {getattr(layout, name)} != {value}"
            for name, value in mine.items()
            if getattr(layout, name) != value
        ]
        return "; ".join(differ) or None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the spelling of ``KVLayout.dtype``)."""
    return DTYPE_NAMES[dtype]


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
    part = _RankPart.of(view, ref.layout, tp_rank, tp_size)
    store_batch = _batch(stores, failed_stores)
    if part.mapping is not None:  # ranks holding the same heads take turns writing a chunk
        store_batch = store_batch.only_slots(part.mapping.is_writer)
    _copy(result, part, kv_cache, store_batch, _batch(loads, failed_loads))
    return result


@dataclass(frozen=True)
class _RankPart:
    """This rank's part of every slot of a region (``view``), its bytes per block, and its
    canonical mapping (None: the layout is per rank)."""

    view: torch.Tensor
    block_bytes: int
    mapping: CanonicalMapping | None

    @classmethod
    def of(cls, view: torch.Tensor, layout: KVLayout, tp_rank: int, tp_size: int) -> _RankPart:
        if not layout.canonical:
            return cls(view[:, tp_rank], layout.rank_block_bytes, None)
        mapping = CanonicalMapping.of(layout.num_kv_heads, tp_size, tp_rank)
        part = canonical_part(view, mapping.run(layout), mapping.num_heads)
        block_bytes = layout.rank_block_bytes * mapping.num_heads // layout.num_kv_heads
        return cls(part, block_bytes, mapping)


def _copy(
    result: KVTransferResult,
    part: _RankPart,
    kv_cache: KVCache,
    stores: CopyBatch,
    loads: CopyBatch,
) -> None:
    """Run the stores, then the loads; record their bytes and seconds in ``result``."""
    head_major = part.mapping is not None
    started = time.perf_counter()
    if stores.block_ids:
        store_blocks(part.view, kv_cache, stores, head_major=head_major)
        result.num_store_bytes = len(stores.block_ids) * part.block_bytes
    loaded = time.perf_counter()
    if loads.block_ids:
        load_blocks(part.view, kv_cache, loads, head_major=head_major)
        result.num_load_bytes = len(loads.block_ids) * part.block_bytes
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
