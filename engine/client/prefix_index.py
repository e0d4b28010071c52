"""The engine client's prefix index (prefix-aware routing): which engine core holds which
cached block hashes, rebuilt from the engine cores' KV events (``bus.messages.kv_events``).

Batches are applied in the order the kv-events stream delivers them. Per engine core it keeps
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
class _EngineBlocks:
    incarnation: str
    hashes: set[bytes] = field(default_factory=set)
    retired: set[str] = field(default_factory=set)
    next_seq: int = 0
    distrusted: bool = False  # entries dropped after a gap: waiting for a snapshot


class PrefixIndex:
    def __init__(self) -> None:
        self._engines: dict[str, _EngineBlocks] = {}
        self.num_gaps = 0
        self.num_batches = 0

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply one engine core's batch; False if ignored (from a retired incarnation)."""
        engine = self._engines.get(batch.engine_id)
        if engine is None:
            engine = self._engines[batch.engine_id] = _EngineBlocks(batch.incarnation)
            engine.next_seq = batch.seq  # joined mid-way (older batches left the stream)
        elif batch.incarnation in engine.retired:
            return False
        elif batch.incarnation != engine.incarnation:
            self._renew(engine, batch.incarnation)
            engine.next_seq = batch.seq
        if batch.seq != engine.next_seq and engine.next_seq >= 0:
            self.num_gaps += 1
            engine.distrusted = True
            engine.hashes.clear()
        engine.next_seq = batch.seq + 1
        self.num_batches += 1
        if engine.distrusted:
            if not batch.events or not isinstance(batch.events[0], AllBlocksCleared):
                return True  # seen, not trusted: still waiting for a snapshot
            engine.distrusted = False
        hashes = engine.hashes
        for event in batch.events:
            match event:
                case BlockStored():
                    hashes.update(event.block_hashes)
                case BlockRemoved():
                    hashes.difference_update(event.block_hashes)
                case AllBlocksCleared():
                    hashes.clear()
        return True

    @staticmethod
    def _renew(engine: _EngineBlocks, incarnation: str) -> None:
        """Follow ``incarnation`` from now on: the current one is retired, its hashes gone."""
        engine.retired.add(engine.incarnation)
        engine.incarnation, engine.next_seq = incarnation, -1
        engine.hashes.clear()
        engine.distrusted = False

    def follow_incarnation(self, engine_id: str, incarnation: str, retired: set[str]) -> None:
        """The client's liveness table says ``engine_id`` lives as ``incarnation`` now, and
        the ones in ``retired`` are over: if the index follows one of those, drop its entries
        and wait for the new one's batches."""
        engine = self._engines.get(engine_id)
        if engine is None or not incarnation or engine.incarnation == incarnation:
            return
        if engine.incarnation in retired and incarnation not in engine.retired:
            self._renew(engine, incarnation)

    def drop_engine(self, engine_id: str) -> None:
        """Forget what ``engine_id`` holds (it is gone); its next batches apply again."""
        engine = self._engines.get(engine_id)
        if engine is not None:
            engine.hashes.clear()

    def incarnation_of(self, engine_id: str) -> str | None:
        """The incarnation of ``engine_id`` whose events the index follows."""
        engine = self._engines.get(engine_id)
        return engine.incarnation if engine is not None else None

    def hashes_of(self, engine_id: str) -> set[bytes]:
        engine = self._engines.get(engine_id)
        return set(engine.hashes) if engine is not None else set()

    def num_cached_blocks(self, engine_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a request (its chained hashes) ``engine_id`` holds."""
        engine = self._engines.get(engine_id)
        if engine is None:
            return 0
        held = engine.hashes
        count = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            count += 1
        return count

    @property
    def num_entries(self) -> int:
        return sum(len(engine.hashes) for engine in self._engines.values())
