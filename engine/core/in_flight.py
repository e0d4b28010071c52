"""Steps in flight (async scheduling): what a step's landing ends, and blocks that must outlive it.

A step is in flight from ``schedule()`` until its result is applied (it *lands*); results land
strictly in step order. Each request counts its steps in flight, their tokens and the output
placeholders they booked (``scheduler_output.build_scheduler_output``). ``InFlightSteps``:

- ``free`` gives a finished or preempted request's blocks back at once, or, while a step that may
  write them is in flight, keeps them (``pending_frees``) until the request's last such step
  lands: a block is never handed to another request while a step may still write it;
- ``land`` ends a step's flight on each of its requests (placeholders and in-flight tokens given
  back, pending frees done) and says whose output to ignore: the stale steps of a request
  preempted after they were sent (the worker delivers them; they are not counted), and requests
  finished meanwhile (or replaced by a new request with the same id);
- ``cache_landed`` caches full blocks once the KV behind them has landed.

With one step in flight at a time every step lands before the next ``schedule()``, so nothing is
ever kept and the counts are zero whenever the scheduler looks at them.
"""

from __future__ import annotations

from collections.abc import Mapping

from shoal.engine.core.kv_cache_manager import KVCacheManager
from shoal.engine.core.request import Request, RequestStatus
from shoal.engine.core.scheduler_output import SchedulerOutput

# Blocks kept for a request: (its detached block table, trusted tokens, forget all hashes).
PendingFree = tuple[list[int], int, bool]


class InFlightSteps:
    """Bookkeeping for steps whose results are not back yet, over one KV cache manager."""

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.pending_frees: dict[Request, list[PendingFree]] = {}

    def free(self, request: Request, drop_cached: bool = False) -> None:
        """Free the request's blocks now, or once no in-flight step may write them. Only KV
        that has landed is trusted (``drop_cached``: none of it)."""
        kv = self.kv_cache_manager
        blocks = kv.take_blocks(request)
        if not request.num_in_flight_steps:
            kv.free_blocks(blocks, request.num_landed_tokens, drop_cached)
        elif blocks:
            entry = (blocks, request.num_landed_tokens, drop_cached)
            self.pending_frees.setdefault(request, []).append(entry)

    def is_pending(self, request: Request) -> bool:
        """The request's blocks wait for a step in flight."""
        return request in self.pending_frees

    def land(
        self,
        scheduler_output: SchedulerOutput,
        live_requests: Mapping[str, Request],
        wrote_kv: bool = True,
    ) -> set[str]:
        """The step's result arrived: end its flight and return the ids whose output to ignore.
        Idempotent. ``wrote_kv=False``: a step abandoned with its result unknown (its requests
        are about to fail): the blocks it frees forget their hashes."""
        if scheduler_output.landed:
            return scheduler_output.skipped_req_ids
        scheduler_output.landed = True
        skipped = scheduler_output.skipped_req_ids
        num_scheduled = scheduler_output.num_scheduled_tokens
        num_placeholders = scheduler_output.num_placeholders
        pending_frees = self.pending_frees
        free_blocks = self.kv_cache_manager.free_blocks
        for request_id, request in scheduler_output.requests.items():
            request.num_in_flight_steps -= 1
            if request.num_stale_steps:
                request.num_stale_steps -= 1
                skipped.add(request_id)
            else:
                request.num_in_flight_tokens -= num_scheduled[request_id]
                request.num_output_placeholders -= num_placeholders.get(request_id, 0)
                if live_requests.get(request_id) is not request:
                    skipped.add(request_id)
            if pending_frees and not request.num_in_flight_steps and request in pending_frees:
                for blocks, num_trusted, drop_cached in pending_frees.pop(request):
                    free_blocks(blocks, num_trusted, drop_cached or not wrote_kv)
        return skipped

    def cache_landed(self, scheduler_output: SchedulerOutput) -> None:
        """Cache the full blocks of the step's running requests whose KV has landed (when
        blocks are not cached at allocation already)."""
        kv = self.kv_cache_manager
        if not kv.enable_caching or kv.cache_on_allocation:
            return
        for request in scheduler_output.requests.values():
            if request.status is RequestStatus.RUNNING:
                kv.cache_blocks(request, request.num_landed_tokens)
