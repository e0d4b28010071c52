"""Expert parallelism: rank r of an EP group owns experts ``[r * n, (r + 1) * n)`` with
``n = num_experts // size``. Each rank routes its own tokens, sends every (token, expert) pair to
the expert's owner (``dispatch``), the owner runs its local experts with the fused-MoE kernel and
sends the weighted results back (``combine``), and the sender sums them into token order.

The index math (``plan_dispatch``, ``combine_into_tokens``, ``inverse_permutation``) is pure and
needs no process group; ``start_all_to_all`` is the one thin wrapper over the collective (gloo
on the CPU, NCCL on CUDA). Every rank of the group must call ``expert_parallel_moe`` once per
MoE layer, with zero tokens too, or the others block.

Dual-batch overlap: each all-to-all of a layer (counts, dispatch, combine) is issued
asynchronously, then ``dbo_yield()`` hands the turn to the other micro-batch, which computes
while it is in flight, and the result is awaited when the turn comes back. Outside DBO the yield
does nothing and the wait follows the issue at once. Collective order across ranks: every rank
runs the same model over the same number of micro-batches (the split is agreed by all ranks,
and an idle rank never splits), each micro-batch yields exactly three times per MoE layer
whatever its token count, and the ping-pong interleaving depends only on those yields, so every
rank issues the same sequence of collectives.

``EPContext.link_delay_s`` and ``link_bytes_per_s`` inject a cross-host link for benchmarks
only: each all-to-all's completion is observable no earlier than its issue time plus the
delay, plus, with a bandwidth, the time its bytes for other ranks take on this rank's link
(one link per process: transfers queue behind each other). A sync call returns after it; an
async one's ``wait`` blocks until then, so under DBO it overlaps the other micro-batch's
compute."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shoal.kernels import ops
from shoal.workers.dbo.ubatching import dbo_yield


@dataclass(frozen=True)
class EPContext:
    """This worker's rank in an expert-parallel group of ``size`` ranks (``group`` None = the
    default process group). ``link_delay_s`` and ``link_bytes_per_s``: injected latency and
    bandwidth of every all-to-all, for benchmarks that emulate a cross-host link (0: none)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    link_delay_s: float = 0.0
    link_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad expert-parallel rank {self.rank} of size {self.size}")
        for name in ("link_delay_s", "link_bytes_per_s"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")

    def experts_per_rank(self, num_experts: int) -> int:
        if num_experts % self.size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by expert-parallel size {self.size}"
            )
        return num_experts // self.size

    def local_experts(self, num_experts: int) -> range:
        """The global ids of the experts this rank holds, contiguous."""
        n = self.experts_per_rank(num_experts)
        return range(self.rank * n, (self.rank + 1) * n)

    def owner_of(self, expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
        """The rank holding each expert id (same shape)."""
        return torch.div(expert_ids, self.experts_per_rank(num_experts), rounding_mode="floor")


@dataclass(frozen=True)
class DispatchPlan:
    """Where this rank's (token, expert) pairs go: ``order`` sorts the flat pairs by owner rank
    (stable, so pairs keep token order within an owner), ``send_counts[r]`` pairs go to rank r,
    and ``token_of[i]`` is the token of the i-th sorted pair."""

    order: torch.Tensor  # [P] flat pair index, sorted by owner
    send_counts: list[int]  # [size], sums to P
    token_of: torch.Tensor  # [P] token index of each sorted pair


def plan_dispatch(expert_ids: torch.Tensor, ep: EPContext, num_experts: int) -> DispatchPlan:
    """Sort the pairs of ``expert_ids`` [T, top_k] by the rank owning their expert."""
    top_k = expert_ids.shape[1] if expert_ids.dim() == 2 else 1
    flat = expert_ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"expert ids outside [0, {num_experts})")
    owners = ep.owner_of(flat, num_experts)
    order = torch.sort(owners, stable=True).indices
    counts = torch.bincount(owners, minlength=ep.size)
    return DispatchPlan(
        order=order,
        send_counts=[int(c) for c in counts.tolist()],
        token_of=torch.div(order, top_k, rounding_mode="floor"),
    )


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] == i``: puts sorted pairs back into their flat order."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return inv


def combine_into_tokens(
    results: torch.Tensor, plan: DispatchPlan, num_tokens: int
) -> torch.Tensor:  # [P, hidden] in sorted-pair order -> [T, hidden]
    """Sum each token's returned (already weighted) expert outputs."""
    out = torch.zeros((num_tokens, results.shape[1]), dtype=results.dtype, device=results.device)
    return out.index_add_(0, plan.token_of, results)


class PendingAllToAll:
    """An all-to-all in flight; ``wait`` returns the rows received once the collective is done
    and no earlier than its issue time plus ``EPContext.link_delay_s`` (the injected latency)."""

    def __init__(self, recv: torch.Tensor, send: torch.Tensor, work: Any, ready_at: float):
        self.recv = recv
        self._send = send  # kept alive until the collective is done
        self._work = work
        self.ready_at = ready_at  # perf_counter time

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        remaining = self.ready_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return self.recv


class InjectedLink:
    """This process's emulated link (benchmarks): when it is free again, and what it carried."""

    def __init__(self) -> None:
        self.free_at = 0.0  # perf_counter time
        self.counting = False  # count ``bytes_sent`` without a bandwidth too (calibration)
        self.bytes_sent = 0
        self._lock = threading.Lock()

    def ready_at(self, issued_at: float, num_bytes: int, ep: EPContext) -> float:
        """When a transfer of ``num_bytes`` issued at ``issued_at`` has arrived."""
        if not self.counting and ep.link_bytes_per_s <= 0.0:  # serving: nothing to track
            return issued_at + ep.link_delay_s
        with self._lock:
            self.bytes_sent += num_bytes
            if ep.link_bytes_per_s <= 0.0 or num_bytes == 0:
                return issued_at + ep.link_delay_s
            self.free_at = max(self.free_at, issued_at) + num_bytes / ep.link_bytes_per_s
            return self.free_at + ep.link_delay_s


INJECTED_LINK = InjectedLink()


def start_all_to_all(
    send: torch.Tensor, send_counts: list[int], recv_counts: list[int], ep: EPContext
) -> PendingAllToAll:
    """Issue the all-to-all: rows ``send[...]`` split by ``send_counts`` go to each rank; the
    pending result holds the rows received, ``recv_counts[r]`` from rank r, in rank order.
    Zero rows are fine (the call still happens)."""
    issued_at = time.perf_counter()
    remote_rows = sum(send_counts) - send_counts[ep.rank]
    row_bytes = send[0].numel() * send.element_size() if send.shape[0] else 0
    ready_at = INJECTED_LINK.ready_at(issued_at, remote_rows * row_bytes, ep)
    recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
    send = send.contiguous()
    work = dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=recv_counts,
        input_split_sizes=send_counts,
        group=ep.group,
        async_op=True,
    )
    return PendingAllToAll(recv, send, work, ready_at)


def all_to_all(
    send: torch.Tensor, send_counts: list[int], recv_counts: list[int], ep: EPContext
) -> torch.Tensor:
    """``start_all_to_all`` and wait for it."""
    return start_all_to_all(send, send_counts, recv_counts, ep).wait()


def start_count_exchange(
    send_counts: list[int], ep: EPContext, device: torch.device
) -> PendingAllToAll:
    """Issue the exchange of pair counts (one count per rank goes each way); the pending result
    holds how many pairs each rank sends to this one."""
    send = torch.tensor(send_counts, dtype=torch.int64, device=device)
    ones = [1] * ep.size
    return start_all_to_all(send, ones, ones, ep)


def pack_pairs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One byte row per pair (its hidden state, expert id, weight), so a single all-to-all
    carries the dispatch: [P, hidden] x, [P] int64 ids, [P] x.dtype weights -> [P, bytes]."""
    num_pairs = x.shape[0]
    return torch.cat(
        (
            x.contiguous().view(torch.uint8),
            ids.to(torch.int64).reshape(num_pairs, 1).view(torch.uint8),
            weights.to(x.dtype).reshape(num_pairs, 1).contiguous().view(torch.uint8),
        ),
        dim=1,
    )


def unpack_pairs(
    packed: torch.Tensor, hidden: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_pairs``'s inverse: ([P, hidden] x, [P] int64 ids, [P] weights)."""
    width = hidden * dtype.itemsize

    def columns(start: int, stop: int, as_dtype: torch.dtype) -> torch.Tensor:
        part = packed.new_empty((packed.shape[0], stop - start))  # own rows: viewable
        return part.copy_(packed[:, start:stop]).view(as_dtype)

    x = columns(0, width, dtype)
    ids = columns(width, width + 8, torch.int64).reshape(-1)
    weights = columns(width + 8, packed.shape[1], dtype).reshape(-1)
    return x, ids, weights


def expert_parallel_moe(
    x: torch.Tensor,  # [T, hidden]
    weights: torch.Tensor,  # [T, top_k], x's dtype
    ids: torch.Tensor,  # [T, top_k] global expert ids
    w13: torch.Tensor,  # [local experts, 2 * inter, hidden]
    w2: torch.Tensor,  # [local experts, hidden, inter]
    ep: EPContext,
    num_experts: int,
) -> torch.Tensor:  # [T, hidden]
    """Dispatch this rank's pairs to their owners, run the local experts on the pairs received,
    and combine the results back into token order; yields to the other micro-batch (under
    DBO) while each of the three all-to-all steps is in flight."""
    plan = plan_dispatch(ids, ep, num_experts)
    counts = start_count_exchange(plan.send_counts, ep, x.device)
    dbo_yield()
    recv_counts = [int(c) for c in counts.wait().tolist()]
    packed = pack_pairs(
        x[plan.token_of], ids.reshape(-1)[plan.order], weights.reshape(-1)[plan.order]
    )
    dispatch = start_all_to_all(packed, plan.send_counts, recv_counts, ep)
    dbo_yield()
    recv_x, recv_ids, recv_weights = unpack_pairs(dispatch.wait(), x.shape[1], x.dtype)
    first = ep.local_experts(num_experts).start
    local_ids = (recv_ids - first).unsqueeze(1)  # one pair per row: top_k = 1
    results = ops.fused_moe(recv_x, w13, w2, recv_weights.unsqueeze(1), local_ids)
    combine = start_all_to_all(results, recv_counts, plan.send_counts, ep)
    dbo_yield()
    return combine_into_tokens(combine.wait(), plan, x.shape[0])
