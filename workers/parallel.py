"""Tensor parallelism: which shard a worker holds, and the collectives its layers call.

``TPContext(rank, size)`` is passed to every layer. With ``size == 1`` every collective is a no-op
and torch.distributed is never touched. ``init_tensor_parallel`` joins the process group (gloo on
the CPU, NCCL on CUDA) from a ``tcp://host:port`` address shared by all ranks, once per process.
With fault tolerance on, ``TPGroup`` instead joins a group per epoch and can leave it and join a
new one on a fresh port (the worker actor drives it on ``JoinGroup``); an expert-parallel group
(``workers.moe.ep_step``) is rebuilt the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.config.deployment import ShoalConfig
from shoal.workers.group_ports import split_init_method

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPContext:
    """This worker's tensor-parallel rank among ``size`` ranks."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` across ranks, in place; identity when alone."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def any_rank(self, flags: torch.Tensor) -> torch.Tensor:
        """Each element's maximum across ranks, in place (for 0/1 flags: set on any rank);
        identity when alone."""
        if self.size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags

    def broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled tokens on every rank, in place."""
        if self.size > 1:
            dist.broadcast(tokens, src=0)
        return tokens

    def divide(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor-parallel size {self.size}")
        return total // self.size


def init_tensor_parallel(
    rank: int, size: int, init_method: str, *, device: str = "cpu", timeout_s: float = 60.0
) -> TPContext:
    """Join the default process group (once per process) and return this rank's context."""
    join_default_group(rank, size, init_method, device=device, timeout_s=timeout_s)
    return TPContext(rank=rank, size=size)


def join_default_group(
    rank: int, size: int, init_method: str, *, device: str = "cpu", timeout_s: float = 60.0
) -> None:
    """Join the process's default group as ``rank`` of ``size`` at ``init_method`` (gloo on
    the CPU, NCCL on CUDA), unless alone or already joined. Its collectives raise after
    ``timeout_s`` when a peer never arrives."""
    if size > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout_s),
        )


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class TPGroup:
    """This rank's membership of a tensor-parallel group that can be rebuilt (fault tolerance).

    ``leave`` drops the current group even when it is broken (a peer died); rank 0 ``host``s the
    rendezvous store of the next group on a port the OS picks (so never the old one) and returns
    its ``tcp://host:port``; every rank then ``join``s at that address, which blocks until all
    ranks have joined. All three block: the worker calls them in its runner thread."""

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        device: str = "cpu",
        collective_timeout_s: float | None = None,
    ) -> None:
        self.context = TPContext(rank=rank, size=size)
        self.device = device
        # how long a collective of a joined group waits for a peer (None: the join's timeout)
        self.collective_timeout_s = collective_timeout_s
        self.init_method: str | None = None  # the current group's address, once joined
        self._store: dist.TCPStore | None = None

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def size(self) -> int:
        return self.context.size

    def leave(self) -> None:
        """Drop the current group (and the store this rank hosted), if any."""
        self.init_method = None
        self._store = None
        if not dist.is_initialized():
            return
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group may fail to tear down cleanly: it is gone anyway
            log.exception("tensor-parallel rank %d: the old group did not close cleanly", self.rank)
            if dist.is_initialized():
                raise

    def host(self, host: str, timeout_s: float) -> str:
        """Rank 0: listen for the next group's rendezvous on a fresh port of ``host``."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} cannot host the group's rendezvous")
        self._store = dist.TCPStore(
            host,
            0,  # the OS picks a free port: no race with another process, never the old one
            world_size=self.size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        return f"tcp://{host}:{self._store.port}"

    def join(self, init_method: str, timeout_s: float) -> None:
        """Join the group at ``init_method`` (blocks until every rank has joined)."""
        if dist.is_initialized():
            raise RuntimeError("leave the old tensor-parallel group before joining a new one")
        store = self._store
        if store is None:
            host, port = split_init_method(init_method)
            store = dist.TCPStore(
                host, port, world_size=self.size, timeout=timedelta(seconds=timeout_s)
            )
        dist.init_process_group(
            "nccl" if self.device.startswith("cuda") else "gloo",
            store=store,
            rank=self.rank,
            world_size=self.size,
            timeout=timedelta(seconds=self.collective_timeout_s or timeout_s),
        )
        self._store = store  # keeps rank 0's listener alive while the group lives
        self.init_method = init_method


def rebuildable_group(
    config: ShoalConfig, tp_rank: int, dp_rank: int, device: str
) -> TPGroup | None:
    """With fault tolerance on, the group this worker rebuilds on ``JoinGroup``: the
    expert-parallel group of every data-parallel rank's worker, or else its engine core's
    tensor-parallel group; None when there is no group or it is static."""
    if not config.fault_tolerance_config.enable_fault_tolerance:
        return None
    parallel = config.parallel_config
    timeout_s = parallel.step_timeout_s  # as a static group's collectives
    if parallel.expert_parallel_size > 1:
        size = parallel.expert_parallel_size
        return TPGroup(dp_rank, size, device=device, collective_timeout_s=timeout_s)
    if parallel.tensor_parallel_size > 1:
        size = parallel.tensor_parallel_size
        return TPGroup(tp_rank, size, device=device, collective_timeout_s=timeout_s)
    return None
