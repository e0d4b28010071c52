"""The canonical KV layout, seen from one tensor-parallel rank: which of the model's KV heads it
holds, where their bytes lie in a canonical slot, and which chunks it writes. Pure (no torch):
``workers.kv_transfer`` builds its region views from it.

A canonical slot (``KVLayout.canonical``) is ``[layer][k|v][block_in_chunk][kv_head][block_size,
head_dim]`` over every KV head of the model, in global head order. Rank ``r`` of ``tp_size``
holds the heads ``qkv_linear`` (``workers.layers.linear``) gives it: ``num_kv_heads // tp_size``
from ``r * that`` when there are at least as many heads as ranks, else the one head
``r // (tp_size // num_kv_heads)``, replicated on ``tp_size // num_kv_heads`` ranks. Its bytes
of a slot are one ``CopyRun``: a fragment of ``num_heads * block_size * head_dim`` elements per
(layer, k|v, block), back to back in the rank's own chunk (``[layer][k|v][block][head]
[block_size, head_dim]``) and ``num_kv_heads * block_size * head_dim`` apart in the slot.

Ranks that hold the same heads hold the same bytes, so they take turns writing, chunk by chunk:
``is_writer(slot) = slot % num_writers == writer_index`` (vLLM's offloaded block is a chunk);
every rank reads (loads) its own heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.bus.messages.offload import KVLayout


@dataclass(frozen=True)
class CopyRun:
    """``num_fragments`` fragments of ``fragment_size`` bytes: the i-th at ``local_offset + i *
    local_stride`` of a rank's chunk and at ``canonical_offset + i * canonical_stride`` of a
    canonical slot."""

    local_offset: int
    canonical_offset: int
    fragment_size: int
    num_fragments: int
    local_stride: int
    canonical_stride: int


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads per rank: ``num_kv_heads`` split over ``tp_size`` ranks, or one (replicated)
    when there are fewer heads than ranks; ``ValueError`` when neither divides the other."""
    if num_kv_heads < 1 or tp_size < 1:
        raise ValueError(f"{num_kv_heads} KV heads over {tp_size} ranks")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor-parallel size {tp_size} is not a multiple of {num_kv_heads}")
    return 1


@dataclass(frozen=True)
class CanonicalMapping:
    """One rank's heads ``[head_start, head_start + num_heads)`` of the model's
    ``num_kv_heads``, and its turn among the ``num_writers`` ranks that hold the same ones."""

    num_kv_heads: int
    head_start: int
    num_heads: int
    num_writers: int
    writer_index: int

    @classmethod
    def of(cls, num_kv_heads: int, tp_size: int, tp_rank: int) -> CanonicalMapping:
        num_heads = local_kv_heads(num_kv_heads, tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tensor-parallel rank {tp_rank} is outside [0, {tp_size})")
        if num_kv_heads >= tp_size:
            return cls(num_kv_heads, tp_rank * num_heads, num_heads, 1, 0)
        replicas = tp_size // num_kv_heads
        return cls(num_kv_heads, tp_rank // replicas, 1, replicas, tp_rank % replicas)

    def is_writer(self, slot: int) -> bool:
        """Whether this rank writes the chunk in region slot ``slot``."""
        return slot % self.num_writers == self.writer_index

    def run(self, layout: KVLayout) -> CopyRun:
        """Where this rank's bytes of a chunk lie in a slot of ``layout`` (canonical, of
        ``num_kv_heads`` heads)."""
        if not layout.canonical or layout.num_kv_heads != self.num_kv_heads:
            raise ValueError(f"not a canonical layout of {self.num_kv_heads} KV heads: {layout}")
        head_bytes = layout.block_size * layout.head_dim * layout.itemsize
        fragment = self.num_heads * head_bytes
        return CopyRun(
            local_offset=0,
            canonical_offset=self.head_start * head_bytes,
            fragment_size=fragment,
            num_fragments=layout.num_layers * 2 * layout.blocks_per_chunk,
            local_stride=fragment,
            canonical_stride=self.num_kv_heads * head_bytes,
        )
