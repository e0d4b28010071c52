"""The block pool's KV-event log: what entered and left the prefix cache since the last take.

``BlockPool`` calls it (only when one is attached: no cost otherwise) where hashes enter its
map (``stored``), leave it (``removed``) and where the whole map is forgotten (``cleared``).
The engine shell takes the events once per step (``take``) and publishes them as one
``KVEventBatch``. Replaying every event ever taken, in order, gives exactly the set of hashes
in the pool's map; a clear drops the events before it (they no longer matter).
"""

from __future__ import annotations

from shoal.bus.messages.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVEventLog:
    """Events not yet taken, in order; consecutive removals share one ``BlockRemoved``."""

    __slots__ = ("block_size", "events")

    def __init__(self, block_size: int = 0) -> None:
        self.block_size = block_size
        self.events: list[KVEvent] = []

    def stored(self, block_hashes: list[bytes], parent_block_hash: bytes | None) -> None:
        if block_hashes:
            self.events.append(BlockStored(block_hashes, parent_block_hash, self.block_size))

    def removed(self, block_hash: bytes) -> None:
        events = self.events
        if events and isinstance(last := events[-1], BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self.events = [AllBlocksCleared()]

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


def snapshot_events(block_hashes: list[bytes], block_size: int) -> list[KVEvent]:
    """The events that rebuild a cache holding ``block_hashes`` from nothing (the first batch
    of an incarnation)."""
    events: list[KVEvent] = [AllBlocksCleared()]
    if block_hashes:
        events.append(BlockStored(block_hashes, None, block_size))
    return events


def split_events(events: list[KVEvent], max_units: int) -> list[list[KVEvent]]:
    """``events`` cut into runs of at most ``max_units`` units each (one batch per run, so no
    batch outgrows the bus's payload limit), in order: a hash is a unit, and so is each event
    (its tag and parent hash). A long event is cut into pieces; a ``BlockStored`` piece has the
    last hash of the piece before it as parent. Replaying the runs in order replays ``events``."""
    max_units = max(2, max_units)
    runs: list[list[KVEvent]] = [[]]
    room = max_units
    for event in events:
        hashes = [] if isinstance(event, AllBlocksCleared) else event.block_hashes
        start = 0
        while True:
            if room < (2 if hashes else 1):
                runs.append([])
                room = max_units
            piece = hashes[start : start + room - 1]
            runs[-1].append(_piece(event, piece, hashes[start - 1] if start else None))
            start += len(piece)
            room -= 1 + len(piece)
            if start >= len(hashes):
                break
    return runs if runs[0] else []


def _piece(event: KVEvent, hashes: list[bytes], parent: bytes | None) -> KVEvent:
    match event:
        case AllBlocksCleared():
            return event
        case BlockRemoved():
            return BlockRemoved(hashes)
        case BlockStored():
            parent = parent if parent is not None else event.parent_block_hash
            return BlockStored(hashes, parent, event.block_size)
