"""The engine client's prefix index (prefix-aware routing): which source holds which cached
block hashes, rebuilt from the KV events (``bus.messages.kv_events``) of the engine cores and
of the offload tiers (a source is either; its id is the batch's ``engine_id``).

Hashes are kept per source and ``medium`` (None: an engine core's device cache; a tier's type,
"cpu", "fs", "obj"), with the ``block_size`` its ``BlockStored`` events give: a tier's is the
tokens of a chunk, which is keyed by its last block's hash, so its leading blocks are counted a
chunk (``block_size // index block_size`` blocks) at a time.

Batches are applied in the order the kv-events stream delivers them. Per source it keeps
the incarnation it is following: a batch from a new incarnation (a restarted engine core, whose
first batch is a snapshot) drops what was known of the old one, whose later batches are then
ignored; ``AllBlocksCleared`` (a reset, or a snapshot) drops it too, as does ``drop_engine``
(the client saw the engine core DEAD or STOPPED), and so does ``follow_incarnation`` when the
client's liveness table knows a newer incarnation than the one followed (its snapshot is late:
the old life's hashes must not steer meanwhile).

A missing ``seq`` (``num_gaps``) means lost events, perhaps removals: the engine core's entries
are dropped and batches are ignored until its next snapshot (engine cores send one
periodically), rather than steering by possibly stale hashes. A client joining mid-way (the
stream no longer holds the snapshot) applies what it sees: stores are true, and removals of
unknown hashes harmless. The index is a routing hint: a wrong guess costs a recomputed prefix,
never a wrong output. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.bus.messages.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


@dataclass(slots=True)
class _Held:
    """One medium's hashes of a source, and its events' block size (0: not said)."""

    hashes: set[bytes] = field(default_factory=set)
    block_size: int = 0


@dataclass(slots=True)
class _SourceBlocks:
    incarnation: str
    media: dict[str | None, _Held] = field(default_factory=dict)
    retired: set[str] = field(default_factory=set)
    next_seq: int = 0
    distrusted: bool = False  # entries dropped after a gap: waiting for a snapshot


class PrefixIndex:
    """``block_size``: the engine cores' (the tokens of a block a request's hashes name)."""

    def __init__(self, block_size: int = 0) -> None:
        self.block_size = block_size
        self._sources: dict[str, _SourceBlocks] = {}
        self.num_gaps = 0
        self.num_batches = 0

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply one engine core's batch; False if ignored (from a retired incarnation)."""
        source = self._sources.get(batch.engine_id)
        if source is None:
            source = self._sources[batch.engine_id] = _SourceBlocks(batch.incarnation)
            source.next_seq = batch.seq  # joined mid-way (older batches left the stream)
        elif batch.incarnation in source.retired:
            return False
        elif batch.incarnation != source.incarnation:
            self._renew(source, batch.incarnation)
            source.next_seq = batch.seq
        if batch.seq != source.next_seq and source.next_seq >= 0:
            self.num_gaps += 1
            source.distrusted = True
            source.media.clear()
        source.next_seq = batch.seq + 1
        self.num_batches += 1
        if source.distrusted:
            if not batch.events or not isinstance(batch.events[0], AllBlocksCleared):
                return True  # seen, not trusted: still waiting for a snapshot
            source.distrusted = False
        media = source.media
        for event in batch.events:
            match event:
                case BlockStored():
                    held = media.setdefault(event.medium, _Held())
                    held.hashes.update(event.block_hashes)
                    held.block_size = event.block_size or held.block_size
                case BlockRemoved():
                    if (held_of := media.get(event.medium)) is not None:
                        held_of.hashes.difference_update(event.block_hashes)
                case AllBlocksCleared():
                    media.clear()
        return True

    @staticmethod
    def _renew(source: _SourceBlocks, incarnation: str) -> None:
        """Follow ``incarnation`` from now on: the current one is retired, its hashes gone."""
        source.retired.add(source.incarnation)
        source.incarnation, source.next_seq = incarnation, -1
        source.media.clear()
        source.distrusted = False

    def follow_incarnation(self, source_id: str, incarnation: str, retired: set[str]) -> None:
        """The client's liveness table says ``source_id`` lives as ``incarnation`` now, and
        the ones in ``retired`` are over: if the index follows one of those, drop its entries
        and wait for the new one's batches."""
        source = self._sources.get(source_id)
        if source is None or not incarnation or source.incarnation == incarnation:
            return
        if source.incarnation in retired and incarnation not in source.retired:
            self._renew(source, incarnation)

    def drop_source(self, source_id: str) -> None:
        """Forget what ``source_id`` holds (it is gone); its next batches apply again."""
        source = self._sources.get(source_id)
        if source is not None:
            source.media.clear()

    def incarnation_of(self, source_id: str) -> str | None:
        """The incarnation of ``source_id`` whose events the index follows."""
        source = self._sources.get(source_id)
        return source.incarnation if source is not None else None

    def _held(self, source_id: str, medium: str | None) -> _Held | None:
        source = self._sources.get(source_id)
        return source.media.get(medium) if source is not None else None

    def hashes_of(self, source_id: str, medium: str | None = None) -> set[bytes]:
        held = self._held(source_id, medium)
        return set(held.hashes) if held is not None else set()

    def stride(self, source_id: str, medium: str | None = None) -> int:
        """Blocks per hash ``source_id`` publishes in ``medium``: a tier's chunk's (1 while the
        block sizes are not known)."""
        held = self._held(source_id, medium)
        if held is None or not held.block_size or not self.block_size:
            return 1
        return max(1, held.block_size // self.block_size)

    def num_cached_blocks(
        self,
        source_id: str,
        block_hashes: Sequence[bytes],
        medium: str | None = None,
        start: int = 0,
    ) -> int:
        """How many leading blocks of a request (its chained hashes) ``source_id`` holds in
        ``medium``, a chunk (``stride``) at a time, given that its first ``start`` blocks are
        held elsewhere (the device's: a tier then counts from the chunk they end in)."""
        held = self._held(source_id, medium)
        if held is None:
            return start
        stride, hashes = self.stride(source_id, medium), held.hashes
        count = start - start % stride
        while count + stride <= len(block_hashes) and block_hashes[count + stride - 1] in hashes:
            count += stride
        return max(count, start)

    @property
    def num_entries(self) -> int:
        return sum(
            len(held.hashes) for source in self._sources.values() for held in source.media.values()
        )
