"""A CPU tier and a worker for offload tests of the pure scheduler, with no bus and no torch.

``FakeTier`` answers the connector's outbox with a real ``OffloadManager`` (pins, slots,
eviction) and keeps each slot's blocks as the fake KV entries ``(position, token)`` that
``FakeWorker`` writes. ``OffloadWorker`` runs a step's copies first (stores read blocks, loads
write them), so a load of the wrong chunk, or KV trusted after a failed load, fails the fake
worker's own check that every slot attention reads holds the right token at the right position.
``drive`` runs requests to completion, handing the outbox to the tier after every core call
(answers optionally held back a few steps).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from shoal.bus.messages.offload import (
    KVLayout,
    KVTransferResult,
    RegionRef,
    TierLookupReply,
    TierStoreSlots,
)
from shoal.bus.messages.worker import ExecuteStep, StepResult
from shoal.config.deployment import CacheConfig, SchedulerConfig
from shoal.config.kv_transfer import KVTransferConfig
from shoal.engine.core.offload_connector import OffloadOutbox
from shoal.engine.core.offload_port import OffloadPort
from shoal.engine.core.scheduler import Scheduler
from shoal.tiers.books.manager import LookupResult, OffloadManager
from tests.unit.factories import FakeWorker

GENERATION = "gen-1"
KVEntry = tuple[int, int] | None


def make_offload_scheduler(
    *,
    num_blocks: int = 65,
    block_size: int = 4,
    async_scheduling: bool = False,
    max_num_batched_tokens: int = 64,
    **offload: Any,
) -> Scheduler:
    offload.setdefault("cpu_bytes_to_use", 1 << 20)
    return Scheduler(
        SchedulerConfig(
            async_scheduling=async_scheduling,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=16,
        ),
        CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks),
        max_model_len=256,
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", **offload),
    )


def region_for(scheduler: Scheduler, num_slots: int) -> RegionRef:
    assert scheduler.connector is not None
    layout = KVLayout("fake", 1, scheduler.block_size, 1, 1, "float32", 1, 1)
    return RegionRef("/nonexistent", GENERATION, num_slots, layout)


class FakeTier:
    def __init__(
        self, num_slots: int, eviction_policy: str = "lru", generation: str = GENERATION
    ) -> None:
        self.generation = generation
        self.manager = OffloadManager(num_slots, eviction_policy)
        self.slots: dict[int, list[list[KVEntry]]] = {}  # slot → per block, per position
        self.pins: dict[bytes, int] = {}
        self.stored_slots: dict[bytes, int] = {}

    def lookup(self, keys: list[bytes]) -> TierLookupReply:
        held = []
        for key in keys:
            if self.manager.lookup(key) is not LookupResult.HIT:
                break
            held.append(key)
        slot_ids = self.manager.prepare_load(held)
        for key in held:
            self.pins[key] = self.pins.get(key, 0) + 1
        return TierLookupReply(self.generation, slot_ids, usage=self.manager.usage)

    def prepare_store(self, keys: list[bytes]) -> TierStoreSlots:
        out = self.manager.prepare_store(keys)
        if out is None:
            return TierStoreSlots(self.generation, accepted=False)
        self.stored_slots.update(zip(out.keys_to_store, out.slot_ids, strict=True))
        return TierStoreSlots(self.generation, out.keys_to_store, out.slot_ids)

    def release(self, loaded: list[bytes], stored: list[bytes], failed: list[bytes]) -> None:
        for key in loaded:
            self.pins[key] -= 1
        self.manager.complete_load(loaded)
        self.manager.complete_store(stored, True)
        self.manager.complete_store(failed, False)

    @property
    def num_pinned(self) -> int:
        return sum(self.pins.values())


class OffloadWorker(FakeWorker):
    """A fake worker that also runs the step's copies against a ``FakeTier``."""

    def __init__(self, block_size: int, tier: FakeTier, blocks_per_chunk: int = 1) -> None:
        super().__init__(block_size)
        self.tier = tier
        self.blocks_per_chunk = blocks_per_chunk
        self.fail_loads: set[str] = set()  # request ids whose next load fails
        self.num_loaded_blocks = 0

    def execute(self, step: ExecuteStep) -> StepResult:
        failed: list[str] = []
        transfers = step.kv_transfers
        if transfers is not None:
            for store in transfers.stores:
                for block, slot, offset in zip(
                    store.block_ids, store.slot_ids, store.block_offsets, strict=True
                ):
                    chunk = self.tier.slots.setdefault(slot, [[]] * self.blocks_per_chunk)
                    chunk[offset] = [self.kv.get((block, i)) for i in range(self.block_size)]
            for load in transfers.loads:
                if load.req_id in self.fail_loads:
                    self.fail_loads.discard(load.req_id)
                    failed.append(load.req_id)
                    continue
                for block, slot, offset in zip(
                    load.block_ids, load.slot_ids, load.block_offsets, strict=True
                ):
                    for i, entry in enumerate(self.tier.slots[slot][offset]):
                        if entry is not None:
                            self.kv[(block, i)] = entry
                    self.num_loaded_blocks += 1
        if failed:  # left out of the step and dropped from the batch, as the real worker does
            step = _without(step, set(failed))
        result = super().execute(step)
        if transfers is not None:
            result.kv_transfer = KVTransferResult(failed_load_req_ids=failed)
        return result


def _without(step: ExecuteStep, req_ids: set[str]) -> ExecuteStep:
    return ExecuteStep(
        step.step_id,
        [r for r in step.new_requests if r.req_id not in req_ids],
        [r for r in step.cached_requests if r.req_id not in req_ids],
        step.finished_req_ids,
        step.preempted_req_ids,
    )


class Exchange:
    """Carries the connector's outbox to the tier; answers held back ``delay`` exchanges."""

    def __init__(self, scheduler: Scheduler, tier: FakeTier, delay: int = 0) -> None:
        self.scheduler = scheduler
        self.tier = tier
        self.delay = delay
        self._held: deque[tuple[int, Any]] = deque()
        self._ticks = 0
        self.offered: list[bytes] = []  # every key offered for a store

    def __call__(self) -> None:
        connector = self.scheduler.connector
        assert connector is not None
        port = OffloadPort(connector, self.scheduler.unpark)  # the link's door to the core
        self._ticks += 1
        self._send(port.take_outbox("owner"))
        while self._held and self._held[0][0] + self.delay <= self._ticks:
            kind, ident, keys = self._held.popleft()[1]
            if kind == "lookup":
                request_id, lookup_id = ident
                port.lookup_answered(request_id, lookup_id, keys, self.tier.lookup(keys))
            else:
                port.store_answered(ident, self.tier.prepare_store(keys))
        self._send(port.take_outbox("owner"))

    def _send(self, outbox: OffloadOutbox) -> None:
        """Hold the lookups and offers for their answers; release at once."""
        for request_id, lookup_id, keys, _ in outbox.lookups:
            self._held.append((self._ticks, ("lookup", (request_id, lookup_id), keys)))
        for job_id, keys in outbox.offers:
            self._held.append((self._ticks, ("offer", job_id, keys)))
            self.offered.extend(keys)
        release = outbox.release
        if release is not None and release.generation == self.tier.generation:
            self.tier.release(release.loaded_keys, release.stored_keys, release.failed_keys)

    @property
    def idle(self) -> bool:
        return not self._held


def drive(
    scheduler: Scheduler, worker: FakeWorker, exchange: Exchange, max_steps: int = 2000
) -> dict[str, list[int]]:
    """Run every request to completion (and every copy), one step in flight; each request's
    output tokens."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests() and exchange.idle:
            return tokens
        step = scheduler.schedule()
        exchange()
        if step.is_empty:
            continue
        result = worker.execute(step.to_message())
        for outputs in scheduler.update_from_output(step, result).values():
            for output in outputs:
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        exchange()
    raise AssertionError(f"not done after {max_steps} steps")
