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

``seq`` counts batches within one incarnation of an engine core, from 0; a new incarnation is
a new process (or a new life after a bus reconnect) whose first batch starts with
``AllBlocksCleared``.
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, tag="stored", array_like=True, omit_defaults=True, gc=False):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None = None
    block_size: int = 0


class BlockRemoved(msgspec.Struct, tag="removed", array_like=True, omit_defaults=True, gc=False):
    block_hashes: list[bytes]


class AllBlocksCleared(msgspec.Struct, tag="cleared", array_like=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, tag="kv_events", array_like=True, omit_defaults=True, gc=False):
    """The events of one step of one engine core, in the order they happened."""

    engine_id: str
    incarnation: str
    seq: int
    events: list[KVEvent]
    timestamp: float = 0.0


__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "KVEventBatch"]
