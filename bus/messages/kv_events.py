"""Engine core → engine clients: what each engine core's prefix cache holds, as events.

The events of a step of an engine core (only when the step changed the cache), as one
``KVEventBatch`` or, when they are many, several with consecutive ``seq``s (each well under the
bus's payload limit), on ``Subjects.kv_events(engine_id)``, captured by the kv-events JetStream
stream so a client that starts later replays it. Each engine core also sends a snapshot
periodically (see ``AllBlocksCleared``). The events follow vLLM's KV events:

- ``BlockStored``: block hashes that became cached, in chain order; ``parent_block_hash`` is the
  hash of the block before the first of them (None for a prompt's first block, or in a
  snapshot). Token ids are left out (the router needs only the hashes; the stream stays small).
- ``BlockRemoved``: hashes evicted from the prefix cache (their blocks were taken for new data,
  or their KV was not trusted any more).
- ``AllBlocksCleared``: the engine core's prefix cache is empty (a reset), or a snapshot
  starts (the first batch of an incarnation, and one every snapshot interval): the
  ``BlockStored`` after it, in this batch and the next ones, list every cached hash.

An offload tier (``tiers.tier_events``: the CPU tier, the fs and obj secondaries) publishes its
chunks the same way on ``Subjects.tier_kv_events(tier_id)``, the batch's ``engine_id`` being
the tier's id: its events carry ``medium`` (its type: "cpu", "fs", "obj"; None is an engine
core's own KV cache, as vLLM's field), a ``BlockStored`` lists the chunks' keys as block hashes
(a chunk's key is its last block's hash; the KV cache group index is left out, as the engine
core's events leave it) and its ``block_size`` is the tokens of a chunk.

``seq`` counts batches within one incarnation of a source (an engine core or a tier), from 0;
a new incarnation is a new process (or a new life after a bus reconnect) whose first batch
starts with ``AllBlocksCleared``.
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, tag="stored", array_like=True, omit_defaults=True, gc=False):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None = None
    block_size: int = 0
    medium: str | None = None  # None: the engine core's own KV cache; else a tier's type
    lora_name: str | None = None  # the adapter that made them (vLLM's lora_id; in the hashes)


class BlockRemoved(msgspec.Struct, tag="removed", array_like=True, omit_defaults=True, gc=False):
    block_hashes: list[bytes]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="cleared", array_like=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, tag="kv_events", array_like=True, omit_defaults=True, gc=False):
    """The events of one step of one engine core (or of a tier's moment), in order."""

    engine_id: str  # the source: an engine core's id, or a tier's
    incarnation: str
    seq: int
    events: list[KVEvent]
    timestamp: float = 0.0


def snapshot_events(
    block_hashes: list[bytes], block_size: int, medium: str | None = None
) -> list[KVEvent]:
    """The events that rebuild a source holding ``block_hashes`` from nothing (the first batch
    of an incarnation)."""
    events: list[KVEvent] = [AllBlocksCleared()]
    if block_hashes:
        events.append(BlockStored(block_hashes, None, block_size, medium))
    return events


__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "snapshot_events",
]
