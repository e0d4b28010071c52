"""The block pool's KV-event log: what entered and left the prefix cache since the last take.

``BlockPool`` calls it (only when one is attached: no cost otherwise) where hashes enter its
map (``stored``), leave it (``removed``) and where the whole map is forgotten (``cleared``).
The engine shell takes the events once per step (``take``) and publishes them as one
``KVEventBatch`` (``kv_events.publisher``). Replaying every event ever taken, in order,
gives exactly the set of hashes in the pool's map; a clear drops the events before it.
"""

from __future__ import annotations

from shoal.bus.messages.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVEventLog:
    """Events not yet taken, in order; consecutive removals share one ``BlockRemoved``."""

    __slots__ = ("block_size", "events")

    def __init__(self, block_size: int = 0) -> None:
        self.block_size = block_size
        self.events: list[KVEvent] = []

    def stored(
        self,
        block_hashes: list[bytes],
        parent_block_hash: bytes | None,
        lora_name: str | None = None,
    ) -> None:
        if block_hashes:
            self.events.append(
                BlockStored(block_hashes, parent_block_hash, self.block_size, lora_name=lora_name)
            )

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
