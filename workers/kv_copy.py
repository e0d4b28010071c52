"""Copies between this rank's paged KV cache and its part of a CPU tier's region view, for the
blocks of a ``CopyBatch``: runs of consecutive blocks to consecutive region rows copy in one
strided pass each (at most three views per run: the rest of a slot, whole slots, the start of a
slot), with no gathered copy in between; batches too scattered for that gather first, then copy.

A rank's part is ``[S, L, 2, C, block_size, H, D]`` (its own part of every slot, token-major like
the cache) or, canonical, ``[S, L, 2, C, H, block_size, D]`` (its heads of every slot, head-major:
``canonical_part``); with ``head_major`` the cache's blocks are read and written transposed to
match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from shoal.workers.kv_cache import KVCache
from shoal.workers.kv_canonical import CopyRun

# Copy run by run (one pass each) when the runs average this many blocks; else gather first.
MIN_BLOCKS_PER_RUN = 4


@dataclass
class CopyBatch:
    """The blocks to copy one way, flattened from the jobs: one entry per block."""

    block_ids: list[int]
    slot_ids: list[int]
    block_offsets: list[int]

    def only_slots(self, keep: Callable[[int], bool]) -> CopyBatch:
        """The blocks whose slot ``keep`` accepts."""
        kept = [i for i, slot in enumerate(self.slot_ids) if keep(slot)]
        return CopyBatch(
            [self.block_ids[i] for i in kept],
            [self.slot_ids[i] for i in kept],
            [self.block_offsets[i] for i in kept],
        )

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block ids on ``device``, slot ids, block offsets), each ``[B]`` int64."""
        blocks = torch.tensor(self.block_ids, dtype=torch.int64).to(device)
        slots = torch.tensor(self.slot_ids, dtype=torch.int64)
        offsets = torch.tensor(self.block_offsets, dtype=torch.int64)
        return blocks, slots, offsets


class _Run(NamedTuple):
    """Blocks ``[block, block + length)`` ↔ region rows ``[position, position + length)``, a
    row's position being ``slot * blocks_per_chunk + offset``."""

    block: int
    position: int
    length: int


def _runs(batch: CopyBatch, blocks_per_chunk: int) -> list[_Run]:
    runs: list[_Run] = []
    for block, slot, offset in zip(
        batch.block_ids, batch.slot_ids, batch.block_offsets, strict=True
    ):
        position = slot * blocks_per_chunk + offset
        if runs:
            last = runs[-1]
            if block == last.block + last.length and position == last.position + last.length:
                runs[-1] = last._replace(length=last.length + 1)
                continue
        runs.append(_Run(block, position, 1))
    return runs


def _pieces(layer_view: torch.Tensor, run: _Run) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(first block, blocks, region rows) of one layer's K or V for a run, in at most three
    strided views: the rest of its first slot, whole slots (``[slots, C, ...]``: never merged
    into one dimension, which would copy), the start of its last slot."""
    per_slot = layer_view.shape[1]  # layer_view: [S, C, block_size, H, D]
    block, position, left = run
    while left:
        slot, offset = divmod(position, per_slot)
        if offset or left < per_slot:
            count = min(left, per_slot - offset)
            yield block, count, layer_view[slot, offset : offset + count]
        else:
            num_slots = left // per_slot
            count = num_slots * per_slot
            yield block, count, layer_view[slot : slot + num_slots]
        block, position, left = block + count, position + count, left - count


def canonical_part(view: torch.Tensor, run: CopyRun, num_heads: int) -> torch.Tensor:
    """A rank's part of every canonical slot, ``[S, L, 2, C, num_heads, block_size, D]``, over
    ``view`` (``[S, L, 2, C, H, block_size, D]``): the bytes of ``run`` in each slot."""
    num_slots, num_layers, _, per_slot, _, block_size, head_dim = view.shape
    item = view.element_size()
    part = view.as_strided(
        (num_slots, run.num_fragments, run.fragment_size // item),
        (view.stride(0), run.canonical_stride // item, 1),
        view.storage_offset() + run.canonical_offset // item,
    )
    return part.view(num_slots, num_layers, 2, per_slot, num_heads, block_size, head_dim)


def _planes(kv_cache: KVCache, head_major: bool) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(layer, k|v, the cache's blocks ``[N, block_size, H, D]``, or ``[N, H, block_size, D]``
    as a transposed view with ``head_major``)."""
    for layer, pair in enumerate(zip(kv_cache.k, kv_cache.v, strict=True)):
        for kv, cache in enumerate(pair):
            yield layer, kv, cache.transpose(1, 2) if head_major else cache


def _copy_runs(
    rank_view: torch.Tensor,
    kv_cache: KVCache,
    batch: CopyBatch,
    *,
    to_region: bool,
    head_major: bool,
) -> bool:
    """Copy in one pass per run of consecutive blocks and region rows (no gathered copy in
    between); False, copying nothing, when the batch is too scattered for that to pay."""
    runs = _runs(batch, rank_view.shape[3])
    if len(runs) * MIN_BLOCKS_PER_RUN > len(batch.block_ids):
        return False
    for layer, kv, cache in _planes(kv_cache, head_major):
        layer_view = rank_view[:, layer, kv]
        for run in runs:
            for first, count, rows in _pieces(layer_view, run):
                blocks = cache[first : first + count].view(rows.shape)
                if to_region:
                    rows.copy_(blocks)
                else:
                    blocks.copy_(rows)
    return True


def store_blocks(
    rank_view: torch.Tensor, kv_cache: KVCache, batch: CopyBatch, *, head_major: bool = False
) -> None:
    """KV blocks → region slots; ``rank_view`` is ``[S, L, 2, C, block_size, H, D]`` (or
    ``[S, L, 2, C, H, block_size, D]`` with ``head_major``)."""
    if _copy_runs(rank_view, kv_cache, batch, to_region=True, head_major=head_major):
        return
    blocks, slots, offsets = batch.tensors(kv_cache.k[0].device)
    for layer, kv, cache in _planes(kv_cache, head_major):
        gathered = cache.index_select(0, blocks)  # [B, block_size, H, D] (or head-major)
        rank_view[:, layer, kv].index_put_((slots, offsets), gathered.cpu())


def load_blocks(
    rank_view: torch.Tensor, kv_cache: KVCache, batch: CopyBatch, *, head_major: bool = False
) -> None:
    """Region slots → KV blocks."""
    if _copy_runs(rank_view, kv_cache, batch, to_region=False, head_major=head_major):
        return
    device = kv_cache.k[0].device
    blocks, slots, offsets = batch.tensors(device)
    for layer, kv, cache in _planes(kv_cache, head_major):
        chunk = rank_view[:, layer, kv][slots, offsets]  # [B, block_size, H, D] (or head-major)
        cache.index_copy_(0, blocks, chunk.to(device))
