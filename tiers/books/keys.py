"""Offload keys: which bytes name a chunk of KV cache in every tier, on every host.

An offload key is an engine block hash (``shoal.engine.core.block_hash``: sha256 or xxh3-128 over
the parent hash, extra keys and token ids, never Python's ``hash()``) followed by the KV cache
group index as 4 big-endian bytes. A chunk of ``blocks_per_chunk`` consecutive blocks is keyed by
its **last** block's hash: through the hash chain that one hash already names the whole prefix up
to the chunk's end, so two engine cores that computed the same tokens agree on the key.

Only full chunks have keys; a request's trailing partial chunk is never offloaded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

OffloadKey = bytes

GROUP_IDX_BYTES = 4
MAX_GROUP_IDX = (1 << (8 * GROUP_IDX_BYTES)) - 1


def make_offload_key(block_hash: bytes, group_idx: int = 0) -> OffloadKey:
    """``block_hash`` followed by ``group_idx`` as 4 big-endian bytes."""
    if not block_hash:
        raise ValueError("an offload key needs a non-empty block hash")
    if not 0 <= group_idx <= MAX_GROUP_IDX:
        raise ValueError(f"group_idx must be in [0, {MAX_GROUP_IDX}], got {group_idx}")
    return block_hash + group_idx.to_bytes(GROUP_IDX_BYTES, "big")


def _check_key(key: OffloadKey) -> None:
    if len(key) <= GROUP_IDX_BYTES:
        raise ValueError(f"an offload key is longer than {GROUP_IDX_BYTES} bytes, got {len(key)}")


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block hash a key was made from."""
    _check_key(key)
    return key[:-GROUP_IDX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV cache group index a key was made with."""
    _check_key(key)
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big")


class ChunkKey(NamedTuple):
    """One full chunk of a request: its key and the token position where the chunk ends."""

    key: OffloadKey
    end_token: int


def iter_chunk_keys(
    block_hashes: Sequence[bytes],
    blocks_per_chunk: int,
    block_size: int,
    group_idx: int = 0,
    start_chunk: int = 0,
) -> Iterator[ChunkKey]:
    """The keys of a request's full chunks, head to tail, from chunk ``start_chunk`` on.

    Chunk ``i`` covers blocks ``[i * blocks_per_chunk, (i + 1) * blocks_per_chunk)`` and ends at
    token ``(i + 1) * blocks_per_chunk * block_size``; its key is made from its last block's hash.
    """
    if blocks_per_chunk < 1:
        raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if start_chunk < 0:
        raise ValueError(f"start_chunk must be >= 0, got {start_chunk}")
    num_chunks = len(block_hashes) // blocks_per_chunk
    tokens_per_chunk = blocks_per_chunk * block_size
    for chunk in range(start_chunk, num_chunks):
        last_block = (chunk + 1) * blocks_per_chunk - 1
        yield ChunkKey(
            make_offload_key(block_hashes[last_block], group_idx),
            (chunk + 1) * tokens_per_chunk,
        )
