"""Per-request KV block tables on top of the block pool, with prefix-cache lookup.

``get_computed_blocks`` finds the longest run of cached full blocks matching a request's chained
block hashes, capped so that at least the last token is computed (its logits are needed).
``allocate_slots`` takes those hits (a reference each) and new blocks for the tokens about to be
computed, or returns None, changing nothing, when the pool cannot hold them. Full blocks are
cached (hashed into the pool's map) as soon as they are allocated: a worker writes every KV slot
of a step before attention reads any, so a request admitted in the same step may already hit them.
With ``cache_on_allocation=False`` (async scheduling: a later step may be scheduled, and read a
hit, before this one's result is back, and a failed step would leave garbage behind a hash)
nothing is cached at allocation: ``cache_blocks`` caches a block once the step that fills it has
come back.
Prefix-cache counters count tokens (queries, hits), recorded once per request at admission.

An offload connector's hits (``num_external_tokens``) take new blocks that a step loads before its
forward pass. Speculative decoding asks for slots past the known tokens (drafts to verify, a draft
model's lookahead); they are never hashed (hashes cover known tokens only). Seam: a hybrid model
would hold one manager per KV cache group.
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.engine.core.block_pool import BlockPool
from shoal.engine.core.kv_events import KVEventLog
from shoal.engine.core.request import Request

_NO_BLOCKS: list[int] = []


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        cache_on_allocation: bool = True,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.cache_on_allocation = enable_caching and cache_on_allocation
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[int]] = {}  # block ids, per request
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already hashed, per request
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, _NO_BLOCKS).copy()

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks for the request's longest cached prefix, and how many tokens they hold."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.block_pool.get_cached_prefix(request.block_hashes[:max_blocks])
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = _NO_BLOCKS,
        *,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        num_external_tokens: int = 0,
    ) -> list[int] | None:
        """Blocks for ``num_new_tokens`` more tokens after the computed ones and the hits.

        Layout of the request's table: | computed | new_computed (hits) | external | new |.
        ``num_external_tokens`` (whole blocks) are loaded from an offload tier into the first
        new blocks; nothing is cached at allocation then (``cache_blocks`` once the load has
        landed). Returns the ids of the newly taken blocks (hits excluded), or None when they do
        not fit; then nothing changed. ``full_sequence_must_fit`` also requires room for all the
        request's known tokens.
        """
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
            self.num_cached_blocks[request_id] = 0
        block_size = self.block_size
        num_hits = len(new_computed_blocks)
        num_held = len(blocks) + num_hits
        # Past the known tokens only by drafts and lookahead (never hashed: see the docstring).
        num_tokens = (
            request.num_computed_tokens
            + num_hits * block_size
            + num_external_tokens
            + num_new_tokens
        )
        num_new_blocks = (num_tokens + block_size - 1) // block_size - num_held
        if num_new_blocks > 0 or num_hits or full_sequence_must_fit:
            num_to_check = num_new_blocks
            if full_sequence_must_fit:
                num_known_blocks = (request.num_tokens + block_size - 1) // block_size
                num_to_check = max(num_to_check, num_known_blocks - num_held)
            num_evictable_hits = (
                self.block_pool.num_unreferenced(new_computed_blocks) if num_hits else 0
            )
            if (
                num_to_check + num_evictable_hits
                > self.block_pool.num_free_blocks - reserved_blocks
            ):
                return None
            if num_hits:
                self.block_pool.touch(new_computed_blocks)
                blocks.extend(new_computed_blocks)
                self.num_cached_blocks[request_id] = len(blocks)
        if num_new_blocks > 0:
            new_block_ids = self.block_pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_block_ids)
        else:
            new_block_ids = []
        if (
            self.cache_on_allocation
            and not num_external_tokens
            and num_tokens // block_size > self.num_cached_blocks[request_id]
        ):
            self._cache_full_blocks(request, blocks, num_tokens // block_size)
        return new_block_ids

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's full blocks within its first ``num_tokens`` (KV known written)."""
        num_full = num_tokens // self.block_size
        request_id = request.request_id
        if self.enable_caching and num_full > self.num_cached_blocks.get(request_id, num_full):
            self._cache_full_blocks(request, self.req_to_blocks[request_id], num_full)

    def _cache_full_blocks(self, request: Request, blocks: list[int], num_full: int) -> None:
        hashes = request.block_hashes
        num_full = min(num_full, len(hashes))
        start = self.num_cached_blocks[request.request_id]
        if start < num_full:
            parent = hashes[start - 1] if start else None
            lora = request.lora_request
            self.block_pool.cache_blocks(
                blocks[start:num_full],
                hashes[start:num_full],
                parent,
                None if lora is None else lora.lora_name,
            )
            self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request, drop_cached: bool = False) -> None:
        """Give back the request's blocks now (``take_blocks`` then ``free_blocks``)."""
        self.free_blocks(self.take_blocks(request), request.num_landed_tokens, drop_cached)

    def take_blocks(self, request: Request) -> list[int]:
        """Detach the request's block table (still referenced) to free it later."""
        self.num_cached_blocks.pop(request.request_id, None)
        return self.req_to_blocks.pop(request.request_id, None) or []

    def free_blocks(
        self, blocks: list[int], num_trusted_tokens: int, drop_cached: bool = False
    ) -> None:
        """Give back a detached table, tail first, so its head stays cached the longest.

        Blocks may be hashed when allocated, before their KV is written: those past
        ``num_trusted_tokens`` (KV never written, or by a step whose result has not landed)
        lose their hash, as do all of them with ``drop_cached``.
        """
        if not blocks:
            return
        num_trusted = 0 if drop_cached else max(num_trusted_tokens, 0) // self.block_size
        self.block_pool.free_blocks(reversed(blocks[num_trusted:]), drop_cached=True)
        self.block_pool.free_blocks(reversed(blocks[:num_trusted]))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def record_kv_events(self) -> KVEventLog | None:
        """Start logging the prefix cache's KV events (idempotent); None without prefix
        caching (nothing to log)."""
        pool = self.block_pool
        if not self.enable_caching:
            return None
        if pool.kv_events is None:
            pool.kv_events = KVEventLog(self.block_size)
        return pool.kv_events
