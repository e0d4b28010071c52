"""The decode side of disaggregated prefill on a worker: a step's ``KVPull``s copy remote
prefills' held blocks from the prefill workers' exported caches (``workers.kv_export``) into
this rank's cache, before the forward pass reads them.

A source on this host is read straight out of its mapped file; one on another host through its
worker's TCP server (``workers.kv_export_server``: the read checked by digest and epoch there).
This rank needs the model's KV heads it holds (``workers.kv_canonical``: the same split as a
canonical offload slot); each comes from the first prefill rank holding it, so the two sides'
tensor-parallel sizes may differ. A pull fails whole, and its request is left out of the step
(recomputed by the engine core), when a source is unreadable (another host, gone, not the
file its ref names), its geometry or a block id does not fit, or the exporting worker's epoch
is not the ref's before and after the copy (its engine core's life that held the KV has
ended). With tensor parallelism the ranks ``agree`` on the failures after copying: a pull that
failed on any rank fails on all (a failed pull only ever wrote its own request's blocks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from shoal.bus.messages.kv_handover import KVExportRef, KVPull
from shoal.workers.kv_cache import KVCache
from shoal.workers.kv_canonical import CanonicalMapping
from shoal.workers.kv_export import ExportUnavailable, ExportViews
from shoal.workers.kv_export_server import fetch_blocks
from shoal.workers.kv_transfer import Agree

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadCopy:
    """Heads ``[dst_start, dst_start + num_heads)`` of this rank come from heads ``[src_start,
    ...)`` of ``source``."""

    source: KVExportRef
    src_start: int
    dst_start: int
    num_heads: int


@dataclass
class PullOutcome:
    failed_req_ids: list[str] = field(default_factory=list)
    num_bytes: int = 0
    seconds: float = 0.0


def plan_heads(sources: Sequence[KVExportRef], mine: CanonicalMapping) -> list[HeadCopy]:
    """Where each of this rank's heads comes from; ``ValueError`` if no source holds one."""
    copies: list[HeadCopy] = []
    head = mine.head_start
    end = mine.head_start + mine.num_heads
    while head < end:
        for ref in sources:
            theirs = CanonicalMapping.of(ref.total_kv_heads, ref.tp_size, ref.tp_rank)
            their_end = theirs.head_start + theirs.num_heads
            if theirs.head_start <= head < their_end:
                num = min(end, their_end) - head
                copies.append(HeadCopy(ref, head - theirs.head_start, head - mine.head_start, num))
                head += num
                break
        else:
            raise ValueError(f"no prefill rank holds KV head {head}")
    return copies


def geometry_fault(
    pull: KVPull, kv_cache: KVCache, ref: KVExportRef, mine: CanonicalMapping
) -> str | None:
    """Why ``ref``'s cache cannot feed this one (whose heads are ``mine``) for ``pull``
    (None: it can)."""
    if ref.total_kv_heads != mine.num_kv_heads:
        return (
            f"rank {ref.tp_rank}'s model has {ref.total_kv_heads} KV heads, not {mine.num_kv_heads}"
        )
    theirs = CanonicalMapping.of(ref.total_kv_heads, ref.tp_size, ref.tp_rank)
    if ref.num_kv_heads != theirs.num_heads:
        return f"rank {ref.tp_rank} of {ref.tp_size} says it holds {ref.num_kv_heads} KV heads"
    _, block_size, _, head_dim = kv_cache.k[0].shape
    dtype = str(kv_cache.k[0].dtype).removeprefix("torch.")
    if (ref.num_layers, ref.block_size, ref.head_dim, ref.dtype) != (
        len(kv_cache.k),
        block_size,
        head_dim,
        dtype,
    ):
        return f"rank {ref.tp_rank}'s KV geometry differs from this cache's"
    if len(pull.block_ids) != len(pull.remote_block_ids):
        return "block lists of unequal length"
    if any(not 0 <= b < kv_cache.num_blocks for b in pull.block_ids):
        return "a block id outside this cache"
    if any(not 0 <= b < ref.num_blocks for b in pull.remote_block_ids):
        return f"a remote block id outside rank {ref.tp_rank}'s cache"
    return None


@dataclass(frozen=True)
class Source:
    """Where one ``HeadCopy``'s rows are read: ``pages(layer, 0 for K or 1 for V)`` is a cache
    ``[blocks, block_size, heads, head_dim]``, read at ``block_ids`` (one per pulled block) and
    ``heads``."""

    pages: Callable[[int, int], torch.Tensor]
    block_ids: list[int]
    heads: slice


# Copy run by run (a slice each) when the runs average this many blocks; else gather first.
MIN_BLOCKS_PER_RUN = 4


def block_runs(dst_ids: Sequence[int], src_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first destination block, first source block, length) of each run where both sides
    advance by one block."""
    runs: list[tuple[int, int, int]] = []
    for dst, src in zip(dst_ids, src_ids, strict=True):
        if runs and dst == runs[-1][0] + runs[-1][2] and src == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((dst, src, 1))
    return runs


def copy_heads(kv_cache: KVCache, copy: HeadCopy, block_ids: list[int], source: Source) -> int:
    """Copy one source's heads of the pulled blocks into this cache, every layer, K and V:
    a slice per run of consecutive blocks on both sides (no temporary), or one gather when the
    blocks are scattered; bytes copied."""
    dst_heads = slice(copy.dst_start, copy.dst_start + copy.num_heads)
    runs = block_runs(block_ids, source.block_ids)
    scattered = len(runs) * MIN_BLOCKS_PER_RUN > len(block_ids)
    device = kv_cache.k[0].device
    if scattered:
        dst_index = torch.tensor(block_ids, dtype=torch.int64, device=device)
        src_index = torch.tensor(source.block_ids, dtype=torch.int64)
    num_bytes = 0
    for layer in range(len(kv_cache.k)):
        for kv, pages in ((0, kv_cache.k[layer]), (1, kv_cache.v[layer])):
            src = source.pages(layer, kv)[:, :, source.heads]
            dst = pages[:, :, dst_heads]
            if scattered:
                dst.index_copy_(0, dst_index, src.index_select(0, src_index).to(device))
            else:
                for dst_start, src_start, length in runs:
                    dst[dst_start : dst_start + length].copy_(src[src_start : src_start + length])
            num_bytes += len(block_ids) * src[0].numel() * src.element_size()
    return num_bytes


def pull_one(pull: KVPull, kv_cache: KVCache, mine: CanonicalMapping, views: ExportViews) -> int:
    """Run one pull; its bytes. Raises ``ExportUnavailable`` or ``ValueError`` on a fault."""
    if not pull.block_ids:
        return 0
    copies = plan_heads(pull.source, mine)
    for copy in copies:
        if (fault := geometry_fault(pull, kv_cache, copy.source, mine)) is not None:
            raise ValueError(fault)
    local = [copy for copy in copies if copy.source.host == views.host]
    num_bytes = sum(  # other hosts' through their servers (each read checked there)
        copy_heads(kv_cache, copy, pull.block_ids, fetched_source(pull, copy))
        for copy in copies
        if copy.source.host != views.host
    )
    return num_bytes + pull_local(pull, kv_cache, local, views)


def layer_pages(cache: torch.Tensor, layer: int, kv: int) -> torch.Tensor:
    """One layer's K (0) or V (1) pages of a cache laid out ``[L, 2, blocks, ...]``."""
    return cache[layer, kv]


def fetched_source(pull: KVPull, copy: HeadCopy) -> Source:
    """``copy``'s rows, read from its worker's server on another host (in pull order)."""
    fetched = fetch_blocks(copy.source, pull.remote_block_ids, copy.src_start, copy.num_heads)
    return Source(
        partial(layer_pages, fetched),
        list(range(len(pull.remote_block_ids))),
        slice(0, copy.num_heads),
    )


def pull_local(pull: KVPull, kv_cache: KVCache, copies: list[HeadCopy], views: ExportViews) -> int:
    """The copies from this host's exported caches, mapped, with the epochs checked before and
    after; bytes copied."""
    mapped = {ref: views.map(ref) for ref in dict.fromkeys(copy.source for copy in copies)}
    if any(export.epoch() != ref.epoch for ref, export in mapped.items()):
        raise ExportUnavailable("the prefill worker forgot the held KV (a new epoch)")
    num_bytes = 0
    for copy in copies:
        view = mapped[copy.source].view
        heads = slice(copy.src_start, copy.src_start + copy.num_heads)
        source = Source(partial(layer_pages, view), pull.remote_block_ids, heads)
        num_bytes += copy_heads(kv_cache, copy, pull.block_ids, source)
    if any(export.epoch() != ref.epoch for ref, export in mapped.items()):
        raise ExportUnavailable("the prefill worker forgot the held KV during the copy")
    return num_bytes


def run_kv_pulls(
    pulls: Sequence[KVPull],
    kv_cache: KVCache,
    *,
    mine: CanonicalMapping,
    views: ExportViews,
    agree: Agree | None = None,
) -> PullOutcome:
    """Run a step's pulls; the ids whose pull failed (on any rank, with ``agree``), the bytes
    this rank copied and the seconds it took."""
    started = time.perf_counter()
    outcome = PullOutcome()
    failed = []
    for pull in pulls:
        try:
            outcome.num_bytes += pull_one(pull, kv_cache, mine, views)
            failed.append(False)
        except (ExportUnavailable, ValueError) as exc:
            log.warning("KV pull of %s failed (it is recomputed): %s", pull.req_id, exc)
            failed.append(True)
    if agree is not None:
        failed = agree(failed)
    outcome.failed_req_ids = [pull.req_id for pull, bad in zip(pulls, failed, strict=True) if bad]
    outcome.seconds = time.perf_counter() - started
    return outcome
