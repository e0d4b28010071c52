"""The engine core's side of KV offload: which chunks to look up, load and store, and the copies
each step carries. Pure bookkeeping; the shell (``engine/actor/offload_link.py``) carries the
outbox to the CPU tier actor and feeds its replies back.

- **Lookups.** A waiting request about to be admitted, with full chunks beyond its local
  prefix-cache hit, is *parked* (taken off the waiting queue: it waits for KV without blocking
  the requests behind it) and its chunk keys are put in the outbox. The tier's answer (the
  leading chunks it holds, pinned for this engine core) puts it back in the queue, in arrival order;
  a miss, a failure or a timeout puts it back with nothing to load (it recomputes).
- **Loads.** At admission the usable part of the answer (blocks past the local hit, before the
  last token) becomes external computed tokens: their blocks are allocated with the request's
  others and a ``KVLoad`` rides on the same step, copied before the forward pass reads them.
  Once the step lands the pins are released; a failed load is recomputed (never looked up again).
- **Stores** (``offload_stores.py``). Once a step lands, full chunks whose KV it wrote are offered
  to the tier, their blocks held until copied; with slots granted, a ``KVStore`` rides on the
  next step (a step of copies alone if nothing runs); its landing reports the keys stored or
  failed. Stores give way under backpressure; loads never do.
- **Generations.** Everything granted is tied to the tier's region generation: attaching to a
  new one voids the old grants, and releases name the generation they are for.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Mapping, Set
from dataclasses import dataclass

from shoal.bus.messages.offload import (
    KVLoad,
    KVTransferResult,
    KVTransfers,
    RegionRef,
    TierLookupReply,
    TierRelease,
    TierStoreSlots,
)
from shoal.config.kv_transfer import KVTransferConfig
from shoal.engine.core.block_pool import BlockPool
from shoal.engine.core.offload_stores import OffloadStores
from shoal.engine.core.request import Request
from shoal.engine.core.scheduler_output import SchedulerOutput
from shoal.engine.core.step_outcome import StepOutcome
from shoal.tiers.books.keys import ChunkKey, OffloadKey, iter_chunk_keys


class Admission(enum.Enum):
    PARK = "park"  # a lookup is on its way: wait for the answer


@dataclass(slots=True)
class ExternalHit:
    """The part of a tier's answer a request loads now: blocks ``[first_block, end_block)``."""

    first_block: int
    end_block: int
    slot_ids: list[int]  # per block
    block_offsets: list[int]  # per block

    @property
    def num_blocks(self) -> int:
        return self.end_block - self.first_block


@dataclass(slots=True)
class _Answer:
    """A tier's pinned answer for one request: chunks from ``first_chunk`` on."""

    first_chunk: int
    keys: list[OffloadKey]
    slot_ids: list[int]


@dataclass(slots=True)
class _Lookup:
    """A lookup on its way: its id (a reply must name it) and first chunk."""

    lookup_id: int
    first_chunk: int


# A lookup to send: (request id, lookup id, keys, the tier types it may load from: None for all).
PendingLookup = tuple[str, int, list[OffloadKey], list[str] | None]


@dataclass(slots=True)
class OffloadOutbox:
    """What the connector queued for the tier since the shell last took it: lookups, store
    offers (job id, keys) and the keys to release (None: nothing)."""

    lookups: list[PendingLookup]
    offers: list[tuple[int, list[OffloadKey]]]
    release: TierRelease | None


@dataclass(slots=True)
class OffloadCounters:
    """Cumulative: tokens looked up and found in the tiers, failed lookups, and the bytes and
    seconds of the workers' copies (as their step results report them)."""

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_lookup_failures: int = 0
    num_load_bytes: int = 0
    load_time_s: float = 0.0
    num_store_bytes: int = 0
    store_time_s: float = 0.0

    def count_copies(self, figures: KVTransferResult) -> None:
        self.num_load_bytes += figures.num_load_bytes
        self.num_store_bytes += figures.num_store_bytes
        self.load_time_s += figures.load_time_s
        self.store_time_s += figures.store_time_s


class OffloadConnector:
    def __init__(self, config: KVTransferConfig, block_size: int, block_pool: BlockPool) -> None:
        self.config = config
        self.block_size = block_size
        self.blocks_per_chunk = config.blocks_per_chunk
        self.block_pool = block_pool
        self.region: RegionRef | None = None  # none until the tier answered an attach
        self.counters = OffloadCounters()
        self.cpu_usage = 0.0
        self.parked: dict[str, Request] = {}
        self.no_lookup: set[str] = set()  # recompute these (a failed load or lookup)
        self._answers: dict[str, _Answer] = {}
        self._lookups: dict[str, _Lookup] = {}  # on their way, by request id
        self._lookup_ids = itertools.count(1)
        # step id → (generation, [(request id, keys pinned, tokens loaded)])
        self._loads_by_step: dict[int, tuple[str, list[tuple[str, list[OffloadKey], int]]]] = {}
        self._step_loads: list[tuple[KVLoad, list[OffloadKey], int]] = []
        self.stores = OffloadStores(config, block_size, block_pool, self._chunk_keys)
        # The outbox (``take_outbox``; store offers are ``stores.offers_to_send``).
        self.lookups_to_send: list[PendingLookup] = []
        self._release = TierRelease(owner="")

    @property
    def is_active(self) -> bool:
        return self.region is not None

    @property
    def generation(self) -> str:
        return self.region.generation if self.region is not None else ""

    def set_region(self, region: RegionRef) -> None:
        """The tier's region (after an attach). Another generation (the tier restarted) voids
        what the previous one granted: answers not loaded (their requests look up again),
        stores not sent (their blocks go back), and whatever was to be reported to it. Copies
        already sent run against the old region (a worker that can no longer map it fails
        them); their landing reports nothing to the new tier."""
        if self.region is not None and region.generation != self.region.generation:
            self._answers.clear()
            self.stores.drop_unsent(self.region.generation)  # (not the new tier's to fail)
            self._release = TierRelease(owner="")
        self.region = region

    # ----- admission: lookups and loads

    def on_admission(
        self, request: Request, num_local_blocks: int
    ) -> ExternalHit | Admission | None:
        """What the tiers add to a waiting request's local hit: blocks to load, ``PARK`` (the
        lookup is sent and the request parked: the caller takes it off the queue), or None."""
        request_id = request.request_id
        answer = self._answers.get(request_id)
        if answer is not None:
            if answer.first_chunk * self.blocks_per_chunk <= num_local_blocks:
                return self._usable_part(request, answer, num_local_blocks)
            # The local hit shrank since the lookup (evictions): the answer no longer joins
            # it. Let it go and ask again from the new end of the local hit.
            self._release.loaded_keys.extend(self._answers.pop(request_id).keys)
        if not self.is_active or request_id in self.no_lookup or request.skip_reading_prefix_cache:
            return None
        first_chunk = num_local_blocks // self.blocks_per_chunk
        keys = [c.key for c in self._chunk_keys(request, first_chunk)]
        if not keys or (first_chunk * self.blocks_per_chunk) >= self._max_blocks(request):
            return None
        lookup_id = next(self._lookup_ids)
        tiers = request.sampling_params.kv_load_tiers
        self.lookups_to_send.append((request_id, lookup_id, keys, tiers))
        self._lookups[request_id] = _Lookup(lookup_id, first_chunk)
        self.counters.num_queried_tokens += self._max_blocks(request) * self.block_size - (
            num_local_blocks * self.block_size
        )
        self.parked[request_id] = request
        return Admission.PARK

    def on_lookup_reply(
        self, request_id: str, lookup_id: int, keys: list[OffloadKey], reply: TierLookupReply
    ) -> Request | None:
        """The tier's answer to lookup ``lookup_id`` (of ``keys``); returns the request to queue
        again (None if it is gone, or the lookup is not its current one: the pins go back)."""
        self.cpu_usage = reply.usage
        lookup = self._take_lookup(request_id, lookup_id)
        current = reply.generation == self.generation
        pinned = keys[: len(reply.slot_ids)]
        request = self.parked.pop(request_id, None) if lookup is not None else None
        if request is None or not current:
            if current:
                self._release.loaded_keys.extend(pinned)
            return request  # (another generation's pins are not this one's to give back)
        if pinned:
            assert lookup is not None
            self._answers[request_id] = _Answer(lookup.first_chunk, pinned, list(reply.slot_ids))
        else:
            self.no_lookup.add(request_id)
        return request

    def on_lookup_failed(self, request_id: str, lookup_id: int) -> Request | None:
        """No answer (timeout, tier gone): the request recomputes."""
        if self._take_lookup(request_id, lookup_id) is None:
            return None
        self.counters.num_lookup_failures += 1
        self.no_lookup.add(request_id)
        return self.parked.pop(request_id, None)

    def _take_lookup(self, request_id: str, lookup_id: int) -> _Lookup | None:
        lookup = self._lookups.get(request_id)
        if lookup is None or lookup.lookup_id != lookup_id:
            return None  # a reply to a lookup of a request since finished (its id reused)
        return self._lookups.pop(request_id)

    def commit_load(self, request: Request, hit: ExternalHit, block_ids: list[int]) -> None:
        """The request was admitted with ``hit``'s blocks at ``block_ids``: load them this step."""
        answer = self._answers.pop(request.request_id)
        load = KVLoad(request.request_id, block_ids, hit.slot_ids, hit.block_offsets)
        self._step_loads.append((load, answer.keys, hit.num_blocks * self.block_size))
        self.counters.num_hit_tokens += hit.num_blocks * self.block_size

    def _usable_part(
        self, request: Request, answer: _Answer, num_local_blocks: int
    ) -> ExternalHit | None:
        bpc = self.blocks_per_chunk
        first = max(num_local_blocks, answer.first_chunk * bpc)
        end = min((answer.first_chunk + len(answer.keys)) * bpc, self._max_blocks(request))
        if first >= end:
            self._release.loaded_keys.extend(self._answers.pop(request.request_id).keys)
            return None
        blocks = range(first, end)
        slot_ids = [answer.slot_ids[b // bpc - answer.first_chunk] for b in blocks]
        return ExternalHit(first, end, slot_ids, [b % bpc for b in blocks])

    def _max_blocks(self, request: Request) -> int:
        """Blocks that may come from a cache: all full ones before the last known token."""
        return (request.num_tokens - 1) // self.block_size

    def _chunk_keys(self, request: Request, first_chunk: int) -> Iterator[ChunkKey]:
        return iter_chunk_keys(
            request.block_hashes, self.blocks_per_chunk, self.block_size, start_chunk=first_chunk
        )

    def on_admitted(
        self, request: Request, external: ExternalHit | None, new_block_ids: list[int]
    ) -> None:
        """The request was admitted (its computed tokens set), loading ``external`` into the
        first of ``new_block_ids`` this step if given."""
        if external is not None:
            self.commit_load(request, external, new_block_ids[: external.num_blocks])
        self.stores.on_admitted(request, request.num_computed_tokens)

    def forget(self, request: Request) -> None:
        """The request finished: drop its parking, answer (unpinned) and offer state."""
        request_id = request.request_id
        self.parked.pop(request_id, None)
        self._lookups.pop(request_id, None)
        answer = self._answers.pop(request_id, None)
        if answer is not None:
            self._release.loaded_keys.extend(answer.keys)
        self.no_lookup.discard(request_id)
        self.stores.forget(request_id)

    # ----- stores (``offload_stores.py``)

    def on_store_slots(self, job_id: int, reply: TierStoreSlots | None) -> None:
        """The tier's slots for an offer (None: no answer)."""
        if reply is not None:
            self.cpu_usage = reply.usage
        self.stores.on_slots(job_id, reply, self.generation)

    # ----- the step's copies

    def has_pending_transfers(self) -> bool:
        return self.stores.has_ready

    def build_transfers(self, step_id: int) -> KVTransfers | None:
        """The copies of step ``step_id``: this schedule's loads and the stores with slots."""
        if self.region is None or not (self._step_loads or self.stores.has_ready):
            return None
        loads = [load for load, _, _ in self._step_loads]
        self._loads_by_step[step_id] = (
            self.generation,
            [(load.req_id, keys, n) for load, keys, n in self._step_loads],
        )
        self._step_loads = []
        return KVTransfers(self.region, loads, self.stores.take_ready(step_id))

    def on_landed(
        self,
        scheduler_output: SchedulerOutput,
        result: KVTransferResult | None,
        outcome: StepOutcome,
        skipped: Set[str],
        tables: Mapping[str, list[int]],
    ) -> list[str]:
        """A step landed: finish its copies (``on_step_landed``) and offer the full chunks it
        completed (``tables``: each request's block ids), not of requests it failed, did not run
        (a failed load included) or ran stale: their KV is not what their hashes say. Returns
        the requests whose load succeeded."""
        loaded = self.on_step_landed(scheduler_output.step_id, result)
        if not self.is_active:
            return loaded
        excluded = {r.request_id for r in outcome.failed}
        excluded.update(r.request_id for r, _ in outcome.to_recompute)
        for request_id, request in scheduler_output.requests.items():
            blocks = tables.get(request_id)
            if blocks and request_id not in excluded and request_id not in skipped:
                self.stores.offer_landed(request, blocks, self.generation)
        return loaded

    def on_step_landed(self, step_id: int, result: KVTransferResult | None) -> list[str]:
        """Release the step's pins and finish its stores (``result`` None: the worker reported
        nothing, so every copy failed); returns the requests whose load succeeded. A request
        whose load failed was left out of the step: it is recomputed, without a lookup.
        Copies granted by a previous generation of the tier are not reported to this one."""
        loaded = []
        generation, loads = self._loads_by_step.pop(step_id, ("", []))
        for request_id, keys, num_tokens in loads:
            if generation == self.generation:
                self._release.loaded_keys.extend(keys)
            if result is None or request_id in result.failed_load_req_ids:
                self.no_lookup.add(request_id)
                self.counters.num_hit_tokens -= num_tokens
            else:
                loaded.append(request_id)
        outcome = self.stores.on_step_landed(step_id, result, self.generation)
        self._release.stored_keys.extend(outcome.stored)
        self._release.failed_keys.extend(outcome.failed)
        return loaded

    def abandon(self) -> None:
        """Everything stops (a fault): what no sent step will copy is given back (pins
        released, stores failed, blocks freed). Copies in steps already sent may still run on
        a live worker: they are only forgotten (nothing reported, no longer renewed), so the
        tier keeps their slots until their lease runs out."""
        for request_id in list(self._answers):
            self._release.loaded_keys.extend(self._answers.pop(request_id).keys)
        self._loads_by_step.clear()
        self._release.failed_keys.extend(self.stores.drop_unsent(self.generation))
        self.stores.forget_sent()

    def held_keys(self) -> list[OffloadKey]:
        """What this engine core holds at the current tier, one entry per pin or pending store:
        answers not loaded yet, loads in steps in flight, stores not copied yet. Renewed while
        held, so the tier never reuses their slots."""
        generation = self.generation
        keys = [key for answer in self._answers.values() for key in answer.keys]
        for step_generation, loads in self._loads_by_step.values():
            if step_generation == generation:
                keys += [key for _, step_keys, _ in loads for key in step_keys]
        return keys + self.stores.held_keys(generation)

    def take_outbox(self, owner: str) -> OffloadOutbox:
        """Everything queued for the tier, taken (releases signed by ``owner``)."""
        lookups, self.lookups_to_send = self.lookups_to_send, []
        offers, self.stores.offers_to_send = self.stores.offers_to_send, []
        return OffloadOutbox(lookups, offers, self.take_release(owner))

    def take_release(self, owner: str) -> TierRelease | None:
        """The keys to report to the tier since the last call (None: nothing)."""
        release = self._release
        if not (release.loaded_keys or release.stored_keys or release.failed_keys):
            return None
        self._release = TierRelease(owner="")
        release.owner = owner
        release.generation = self.generation
        return release
