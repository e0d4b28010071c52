"""Chained block hashes for prefix caching, identical across processes and hosts.

The hash of block ``i`` of a request is ``H(parent, extra_keys, token_ids)`` where ``parent`` is
the hash of block ``i - 1`` (``NONE_HASH`` for block 0). ``H`` is sha256 (default) or xxh3-128,
over a fixed byte encoding: the parent digest, a 4-byte length and the extra keys, then each token
id as a little-endian int64. ``NONE_HASH`` is ``H`` of a fixed seed, never random and never
Python's ``hash()``, so two engine cores (or an offload tier on another host) agree on every key.
Only full blocks are hashed. The cache salt is an extra key of block 0 only; through the chain it
changes every later hash. A request's LoRA adapter is an extra key of every block (as vLLM's):
two adapters never share KV, and each block's key says which adapter made it.

Seams: multimodal inputs would add their own extra keys per block; a KV cache group id would be
appended to the key when hybrid models bring several groups.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.engine.core.request import Request

BlockHash = bytes
HashFn = Callable[[bytes], bytes]

NONE_HASH_SEED = b"shoal-none-hash"
_BIG_ENDIAN = sys.byteorder == "big"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def get_hash_fn(algo: str) -> HashFn:
    """The byte hash named by ``CacheConfig.prefix_caching_hash_algo``."""
    if algo == "sha256":
        return _sha256
    if algo == "xxhash":
        try:
            import xxhash
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ValueError("prefix_caching_hash_algo xxhash needs the xxhash package") from exc
        digest: HashFn = xxhash.xxh3_128_digest
        return digest
    raise ValueError(f"prefix_caching_hash_algo must be sha256 or xxhash, got {algo!r}")


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64, the same bytes on every host."""
    packed = array("q", token_ids)
    if _BIG_ENDIAN:  # pragma: no cover - every supported host is little-endian
        packed.byteswap()
    return packed.tobytes()


def salt_extra_key(cache_salt: str | None) -> bytes:
    """The extra-key bytes of block 0 for a cache salt (empty without one)."""
    return b"" if cache_salt is None else b"salt:" + cache_salt.encode()


def extra_keys(index: int, cache_salt: str | None, lora_name: str | None) -> bytes:
    """Block ``index``'s extra-key bytes: the adapter's name, length first (so no salt can pose
    as a salt plus an adapter), then the cache salt (block 0)."""
    salt = salt_extra_key(cache_salt) if index == 0 else b""
    if lora_name is None:
        return salt
    name = lora_name.encode()
    return b"lora:" + len(name).to_bytes(4, "little") + name + salt


def hash_block_tokens(
    hash_fn: HashFn, parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """One link of the chain: the hash of a full block given its parent's hash."""
    header = parent + len(extra_keys).to_bytes(4, "little") + extra_keys
    return hash_fn(header + token_bytes(token_ids))


class BlockHasher:
    """Extends a request's ``block_hashes`` over its newly full blocks (prompt and outputs)."""

    __slots__ = ("block_size", "hash_fn", "none_hash")

    def __init__(self, block_size: int, algo: str = "sha256") -> None:
        self.block_size = block_size
        self.hash_fn = get_hash_fn(algo)
        self.none_hash = self.hash_fn(NONE_HASH_SEED)

    def __call__(self, request: Request) -> list[BlockHash]:
        """The hashes of the request's full blocks that are not hashed yet, in order."""
        hashes = request.block_hashes
        block_size = self.block_size
        tokens = request.all_token_ids
        start = len(hashes)
        end = len(tokens) // block_size
        new_hashes: list[BlockHash] = []
        parent = hashes[-1] if hashes else self.none_hash
        lora = request.lora_request
        lora_name = None if lora is None else lora.lora_name
        for index in range(start, end):
            extra = extra_keys(index, request.cache_salt, lora_name)
            first = index * block_size
            parent = hash_block_tokens(
                self.hash_fn, parent, tokens[first : first + block_size], extra
            )
            new_hashes.append(parent)
        return new_hashes

    def prompt_block_hashes(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        max_blocks: int = -1,
        lora_name: str | None = None,
    ) -> list[BlockHash]:
        """The chained hashes of a prompt's full blocks (at most ``max_blocks``; -1: all), as
        an engine core computes them for a request with this prompt (a router's lookup key)."""
        block_size = self.block_size
        num_blocks = len(token_ids) // block_size
        if max_blocks >= 0:
            num_blocks = min(num_blocks, max_blocks)
        hashes: list[BlockHash] = []
        parent = self.none_hash
        for index in range(num_blocks):
            extra = extra_keys(index, cache_salt, lora_name)
            first = index * block_size
            parent = hash_block_tokens(
                self.hash_fn, parent, token_ids[first : first + block_size], extra
            )
            hashes.append(parent)
        return hashes
