"""The store side of the engine core's KV offload (``offload_connector.py`` is the rest): which
full chunks to offer the CPU tier once a step has written them, the blocks held until a later
step has copied them, and what to report when that step lands.

- A request's chunks are offered once each, in prefix order, when the step that completes them
  lands: newly computed ones (``chunk_level``; chunks within its prefix hit are not) or all
  (``request_level``), prompt chunks only with ``offload_prompt_only``. Past
  ``max_pending_store_chunks`` chunks waiting, offers are dropped (counted).
- An offered chunk's blocks keep one extra reference until its copy has landed (or the offer
  was refused), so no other request reuses them meanwhile.
- A job remembers the tier generation it was offered to; slots of another generation are never
  used, and its outcome is reported only to the generation that granted it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from shoal.bus.messages.offload import KVStore, KVTransferResult, TierStoreSlots
from shoal.config.kv_transfer import KVTransferConfig
from shoal.engine.core.block_pool import BlockPool
from shoal.engine.core.request import Request
from shoal.tiers.books.keys import ChunkKey, OffloadKey

ChunkKeys = Callable[[Request, int], Iterator[ChunkKey]]  # a request's chunk keys from a chunk


@dataclass(slots=True)
class _StoreJob:
    keys: list[OffloadKey]
    blocks: list[list[int]]  # per key, its chunk's block ids (one extra reference each)
    generation: str  # of the region it was offered to
    slot_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StoreOutcome:
    """Keys to report to the tier generation that granted them."""

    stored: list[OffloadKey] = field(default_factory=list)
    failed: list[OffloadKey] = field(default_factory=list)


class OffloadStores:
    def __init__(
        self,
        config: KVTransferConfig,
        block_size: int,
        block_pool: BlockPool,
        chunk_keys: ChunkKeys,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.blocks_per_chunk = config.blocks_per_chunk
        self.block_pool = block_pool
        self._chunk_keys = chunk_keys
        self.num_skipped = 0  # chunks offered but dropped (backpressure, no room)
        self.num_pending_chunks = 0
        self._first_new_chunk: dict[str, int] = {}  # chunks before it were hits
        self._num_offered_chunks: dict[str, int] = {}
        self._jobs: dict[int, _StoreJob] = {}  # waiting for slots or for their step
        self._ready: list[int] = []
        self._by_step: dict[int, list[int]] = {}
        self._job_ids = itertools.count(1)
        self.offers_to_send: list[tuple[int, list[OffloadKey]]] = []  # the outbox

    # ----- requests

    def on_admitted(self, request: Request, num_hit_tokens: int) -> None:
        """Chunks ending within the hit (local and external) are not newly computed."""
        if request.request_id not in self._first_new_chunk:
            tokens_per_chunk = self.blocks_per_chunk * self.block_size
            self._first_new_chunk[request.request_id] = num_hit_tokens // tokens_per_chunk

    def forget(self, request_id: str) -> None:
        self._first_new_chunk.pop(request_id, None)
        self._num_offered_chunks.pop(request_id, None)

    def offer_landed(self, request: Request, blocks: list[int], generation: str) -> None:
        """Offer the request's full chunks whose KV has landed and were not offered yet
        (``blocks``: its block table) to tier ``generation``."""
        tokens_per_chunk = self.blocks_per_chunk * self.block_size
        num_tokens = request.num_landed_tokens
        if self.config.offload_prompt_only:
            num_tokens = min(num_tokens, request.num_prompt_tokens)
        num_blocks = min(len(request.block_hashes), len(blocks))
        num_chunks = min(num_tokens, num_blocks * self.block_size) // tokens_per_chunk
        start = self._num_offered_chunks.get(request.request_id)
        if start is None:
            first_new = self._first_new_chunk.get(request.request_id, 0)
            start = 0 if self.config.offload_policy == "request_level" else first_new
        if num_chunks <= start:
            return
        self._num_offered_chunks[request.request_id] = num_chunks
        if self.num_pending_chunks + num_chunks - start > self.config.max_pending_store_chunks:
            self.num_skipped += num_chunks - start
            return
        self._offer(request, blocks, start, num_chunks, generation)

    def _offer(
        self, request: Request, blocks: list[int], start: int, end: int, generation: str
    ) -> None:
        bpc = self.blocks_per_chunk
        keys, chunk_blocks = [], []
        for chunk in itertools.islice(self._chunk_keys(request, start), end - start):
            index = chunk.end_token // self.block_size
            chunk_blocks.append(blocks[index - bpc : index])
            keys.append(chunk.key)
        for held in chunk_blocks:
            self.block_pool.touch(held)
        job_id = next(self._job_ids)
        self._jobs[job_id] = _StoreJob(keys, chunk_blocks, generation)
        self.num_pending_chunks += len(keys)
        self.offers_to_send.append((job_id, keys))

    def on_slots(self, job_id: int, reply: TierStoreSlots | None, generation: str) -> None:
        """The tier's slots for an offer (None: no answer): copy those, let the rest go. Slots
        of another generation than the job's or the current one (``generation``) are unused."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        slots = {}
        granted = reply is not None and reply.accepted
        if granted and reply is not None and reply.generation == job.generation == generation:
            slots = dict(zip(reply.keys, reply.slot_ids, strict=True))
        kept_keys, kept_blocks = [], []
        for key, blocks in zip(job.keys, job.blocks, strict=True):
            slot_id = slots.get(key)
            if slot_id is None:
                self._drop_chunk(blocks)
                continue
            kept_keys.append(key)
            kept_blocks.append(blocks)
            job.slot_ids.append(slot_id)
        if reply is None or not reply.accepted:
            self.num_skipped += len(job.keys)
        job.keys, job.blocks = kept_keys, kept_blocks
        if kept_keys:
            self._ready.append(job_id)
        else:
            del self._jobs[job_id]

    def _drop_chunk(self, blocks: list[int]) -> None:
        self.block_pool.free_blocks(reversed(blocks))
        self.num_pending_chunks -= 1

    # ----- steps

    @property
    def has_ready(self) -> bool:
        return bool(self._ready)

    def take_ready(self, step_id: int) -> list[KVStore]:
        """The copies that ride on step ``step_id``: every job with slots."""
        stores = [self._message(job_id) for job_id in self._ready]
        self._by_step[step_id] = self._ready
        self._ready = []
        return stores

    def _message(self, job_id: int) -> KVStore:
        job = self._jobs[job_id]
        bpc = self.blocks_per_chunk
        block_ids = [block_id for blocks in job.blocks for block_id in blocks]
        slot_ids = [slot_id for slot_id in job.slot_ids for _ in range(bpc)]
        return KVStore(job_id, block_ids, slot_ids, list(range(bpc)) * len(job.slot_ids))

    def on_step_landed(
        self, step_id: int, result: KVTransferResult | None, generation: str
    ) -> StoreOutcome:
        """The step's copies landed (``result`` None: all failed): blocks given back, and what
        to report to tier ``generation`` (jobs granted by another one report nothing)."""
        outcome = StoreOutcome()
        for job_id in self._by_step.pop(step_id, ()):
            job = self._jobs.pop(job_id)
            if job.generation == generation:
                success = result is not None and job_id not in result.failed_store_job_ids
                (outcome.stored if success else outcome.failed).extend(job.keys)
            for blocks in job.blocks:
                self._drop_chunk(blocks)
        return outcome

    def drop_unsent(self, generation: str) -> list[OffloadKey]:
        """Give back the blocks of every job no sent step will copy; returns the keys whose
        slots tier ``generation`` reserved (to fail there). Jobs in sent steps stay."""
        sent = {job_id for jobs in self._by_step.values() for job_id in jobs}
        failed = []
        for job_id in [j for j in self._jobs if j not in sent]:
            job = self._jobs.pop(job_id)
            if job.slot_ids and job.generation == generation:
                failed += job.keys
            for blocks in job.blocks:
                self._drop_chunk(blocks)
        self._ready.clear()
        return failed

    def forget_sent(self) -> None:
        """A fault: the jobs of steps already sent are forgotten (nothing reported: a live
        worker may still copy them, within their lease), their blocks given back."""
        for job_ids in self._by_step.values():
            for job_id in job_ids:
                for blocks in self._jobs.pop(job_id).blocks:
                    self._drop_chunk(blocks)
        self._by_step.clear()

    def held_keys(self, generation: str) -> list[OffloadKey]:
        """Keys of tier ``generation`` still being stored (one per pending store there)."""
        return [
            key for job in self._jobs.values() if job.generation == generation for key in job.keys
        ]
