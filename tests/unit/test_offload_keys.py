"""Offload keys: block hash + 4-byte big-endian group; a chunk is keyed by its last block."""

from __future__ import annotations

import pytest

from shoal.engine.core.block_hash import BlockHasher
from shoal.tiers.books.keys import (
    ChunkKey,
    get_offload_block_hash,
    get_offload_group_idx,
    iter_chunk_keys,
    make_offload_key,
)
from tests.unit.factories import make_request


def test_key_is_the_hash_then_the_group_big_endian() -> None:
    key = make_offload_key(b"\xab" * 32, 258)
    assert key == b"\xab" * 32 + b"\x00\x00\x01\x02"
    assert get_offload_block_hash(key) == b"\xab" * 32
    assert get_offload_group_idx(key) == 258


@pytest.mark.parametrize("group_idx", [0, 1, 7, 2**32 - 1])
def test_getters_invert_make(group_idx: int) -> None:
    block_hash = bytes(range(16))
    key = make_offload_key(block_hash, group_idx)
    assert (get_offload_block_hash(key), get_offload_group_idx(key)) == (block_hash, group_idx)


def test_groups_never_share_a_key() -> None:
    assert make_offload_key(b"h", 0) != make_offload_key(b"h", 1)


@pytest.mark.parametrize("group_idx", [-1, 2**32])
def test_a_group_out_of_range_is_an_error(group_idx: int) -> None:
    with pytest.raises(ValueError, match="group_idx"):
        make_offload_key(b"h", group_idx)


def test_malformed_keys_are_errors() -> None:
    with pytest.raises(ValueError):
        make_offload_key(b"", 0)
    with pytest.raises(ValueError):
        get_offload_group_idx(b"\x00\x00\x00\x01")


def test_chunks_are_keyed_by_their_last_block_and_end_positions() -> None:
    hashes = [bytes([i]) * 4 for i in range(7)]
    chunks = list(iter_chunk_keys(hashes, blocks_per_chunk=3, block_size=16, group_idx=2))
    assert chunks == [
        ChunkKey(make_offload_key(hashes[2], 2), 48),
        ChunkKey(make_offload_key(hashes[5], 2), 96),
    ]  # block 6 starts a chunk that is not full: no key


def test_one_block_per_chunk_keys_every_block() -> None:
    hashes = [b"a", b"b", b"c"]
    assert [c.key for c in iter_chunk_keys(hashes, 1, 4)] == [make_offload_key(h) for h in hashes]
    assert [c.end_token for c in iter_chunk_keys(hashes, 1, 4)] == [4, 8, 12]


def test_start_chunk_skips_chunks_already_handled() -> None:
    hashes = [bytes([i]) for i in range(8)]
    chunks = list(iter_chunk_keys(hashes, 2, 4, start_chunk=2))
    assert chunks == [
        ChunkKey(make_offload_key(hashes[5]), 24),
        ChunkKey(make_offload_key(hashes[7]), 32),
    ]


@pytest.mark.parametrize(("blocks_per_chunk", "block_size"), [(0, 4), (1, 0)])
def test_bad_chunk_shapes_are_errors(blocks_per_chunk: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        list(iter_chunk_keys([b"a"], blocks_per_chunk, block_size))


def test_two_engines_with_the_same_prefix_compute_the_same_chunk_keys() -> None:
    """Keys come from the deterministic block hashes: a second hasher (another engine core or
    host) agrees; a different prefix changes every later key."""
    tokens = list(range(40))
    a = BlockHasher(4)(make_request("a", tokens))
    b = BlockHasher(4)(make_request("b", tokens))
    c = BlockHasher(4)(make_request("c", [99, *tokens[1:]]))
    keys_a = list(iter_chunk_keys(a, 2, 4))
    assert keys_a == list(iter_chunk_keys(b, 2, 4))
    assert len(keys_a) == 5 and keys_a[-1].end_token == 40
    assert not {k.key for k in keys_a} & {k.key for k in iter_chunk_keys(c, 2, 4)}
