"""The decode side of disaggregated prefill in the engine core (issue 33). Pure bookkeeping; the
shell sends the releases to the prefill engine cores.

A request added with ``KVTransferParams.do_remote_prefill`` names the prefill engine core that
holds its prompt's KV, the blocks there and its workers' exported caches
(``bus.messages.kv_handover``). At admission the part of those tokens beyond the local
prefix-cache hit (and before the last known token, which is computed here for its logits)
becomes external computed tokens: their blocks are allocated with the request's others and a
``KVPull`` rides on the same step, copied by the workers before the forward pass. A request is
pulled at most once: once the step lands, the prefill side is released (``take_releases``)
whatever came of the pull; a failed pull is recomputed (the worker left the request out of the
step, so the scheduler preempts it), as is the request preempted later. A request that ends
before its pull, or needs none (its local hit covers the remote tokens), is released too, and a
request admitted later than half the hold's lease after it arrived is not pulled (released and
recomputed): the prefill side may have freed the blocks at the lease's end, and a freed block
says nothing about what it holds now.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from shoal.bus.messages.engine import KVTransferParams
from shoal.bus.messages.kv_handover import KVPull
from shoal.bus.messages.offload import KVTransferResult
from shoal.engine.core.request import Request, remote_prefill_of


@dataclass(slots=True, frozen=True)
class RemoteHit:
    """The blocks ``[first_block, end_block)`` a request pulls, holding ``num_tokens`` tokens
    after its local hit."""

    first_block: int
    end_block: int
    num_tokens: int

    @property
    def num_blocks(self) -> int:
        return self.end_block - self.first_block


@dataclass(slots=True)
class PullCounters:
    """Cumulative: pulls landed and failed, the tokens pulled (landed pulls) and the tokens of
    remote prefills recomputed here instead (failed pulls), the workers' bytes and seconds."""

    num_pulls: int = 0
    num_failed_pulls: int = 0
    num_pulled_tokens: int = 0
    num_recomputed_tokens: int = 0
    num_pull_bytes: int = 0
    pull_time_s: float = 0.0
    num_late: int = 0  # not pulled: admitted too late in the hold's lease (recomputed)


class RemotePrefills:
    """Requests whose prompt KV a prefill engine core holds for this (decode) engine core."""

    def __init__(self, block_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.clock = clock
        self.counters = PullCounters()
        self._unreleased: dict[str, str] = {}  # request id → the prefill engine core holding
        self._pull_by: dict[str, float] = {}  # request id → its pull's deadline (``clock``)
        self._pulled: set[str] = set()  # admitted with a pull once: never again
        self._step_pulls: list[tuple[KVPull, int]] = []  # this schedule's, with their tokens
        self._pulls_by_step: dict[int, list[tuple[str, int]]] = {}
        self._releases: dict[str, list[str]] = {}  # prefill engine core → request ids

    def track(self, request: Request) -> None:
        """A request was added: remember whom to release if it has a remote prefill, and until
        when its pull is safe (half the hold's lease from now: past it the prefill side may have
        let the blocks go and reused them, and nothing in them would say so)."""
        params = request.remote_prefill
        if params is not None:
            self._unreleased[request.request_id] = params.remote_engine_id
            self._pull_by[request.request_id] = self.clock() + params.lease_s / 2

    def release_unadded(self, request_id: str, params: KVTransferParams | None) -> None:
        """A request that was never added (refused, or done on arrival): release its remote
        prefill, if it has one."""
        if remote_prefill_of(params) is not None:
            assert params is not None
            self._releases.setdefault(params.remote_engine_id, []).append(request_id)

    def on_admission(self, request: Request, num_local_blocks: int) -> RemoteHit | None:
        """What a waiting request pulls beyond its local hit (None: nothing; then the prefill
        side is released at once, or was already)."""
        params = request.remote_prefill
        request_id = request.request_id
        if params is None or request_id in self._pulled or request_id not in self._unreleased:
            return None  # (a released hold is never read: its blocks may hold other KV by now)
        if self.clock() > self._pull_by[request_id]:
            self.counters.num_late += 1
            self._release(request_id)
            return None
        num_tokens = min(params.num_remote_tokens, request.num_tokens - 1)
        num_tokens = min(num_tokens, len(params.remote_block_ids) * self.block_size)
        num_local_tokens = num_local_blocks * self.block_size
        if num_tokens <= num_local_tokens or not params.remote_kv:
            self._release(request_id)
            return None
        end_block = -(-num_tokens // self.block_size)
        return RemoteHit(num_local_blocks, end_block, num_tokens - num_local_tokens)

    def on_admitted(self, request: Request, hit: RemoteHit, new_block_ids: list[int]) -> None:
        """The request was admitted with ``hit``'s tokens computed: pull them this step into the
        first of ``new_block_ids``."""
        params = request.remote_prefill
        assert params is not None
        pull = KVPull(
            request.request_id,
            new_block_ids[: hit.num_blocks],
            params.remote_block_ids[hit.first_block : hit.end_block],
            params.remote_kv,
        )
        self._step_pulls.append((pull, hit.num_tokens))
        self._pulled.add(request.request_id)

    def build(self, step_id: int) -> list[KVPull]:
        """The pulls of step ``step_id`` (those of the schedule just made)."""
        if not self._step_pulls:
            return []
        self._pulls_by_step[step_id] = [(pull.req_id, n) for pull, n in self._step_pulls]
        pulls = [pull for pull, _ in self._step_pulls]
        self._step_pulls = []
        return pulls

    def on_landed(self, step_id: int, result: KVTransferResult | None) -> list[str]:
        """Step ``step_id`` landed (``result`` None: nothing reported, every pull failed):
        release its pulls' prefill sides; the requests whose pull succeeded."""
        pulled = []
        counters = self.counters
        if result is not None:
            counters.num_pull_bytes += result.num_pull_bytes
            counters.pull_time_s += result.pull_time_s
        for request_id, num_tokens in self._pulls_by_step.pop(step_id, []):
            self._release(request_id)
            if result is None or request_id in result.failed_pull_req_ids:
                counters.num_failed_pulls += 1
                counters.num_recomputed_tokens += num_tokens
            else:
                counters.num_pulls += 1
                counters.num_pulled_tokens += num_tokens
                pulled.append(request_id)
        return pulled

    def forget(self, request: Request) -> None:
        """The request finished: its prefill side may go (if not released yet), once no step in
        flight still reads it (that step's landing releases it then)."""
        request_id = request.request_id
        if not any(request_id == r for pulls in self._pulls_by_step.values() for r, _ in pulls):
            self._release(request_id)
        self._pulled.discard(request_id)

    def abandon(self) -> None:
        """Steps in flight will not land (a fault): their pulls count as failed."""
        for step_id in list(self._pulls_by_step):
            self.on_landed(step_id, None)
        self._step_pulls = []

    def take_releases(self) -> dict[str, list[str]]:
        """Prefill engine core → the requests whose held KV it may free, since the last call."""
        releases, self._releases = self._releases, {}
        return releases

    @property
    def num_waiting_release(self) -> int:
        """Requests whose prefill side still holds KV for them."""
        return len(self._unreleased)

    def _release(self, request_id: str) -> None:
        self._pull_by.pop(request_id, None)
        engine_id = self._unreleased.pop(request_id, None)
        if engine_id is not None:
            self._releases.setdefault(engine_id, []).append(request_id)
