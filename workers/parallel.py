"""Tensor parallelism: which shard a worker holds, and the collectives its layers call.

``TPContext(rank, size)`` is passed to every layer. With ``size == 1`` every collective is a no-op
and torch.distributed is never touched. ``init_tensor_parallel`` joins the process group (gloo on
the CPU, NCCL on CUDA) from a ``tcp://host:port`` address shared by all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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
    if size > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout_s),
        )
    return TPContext(rank=rank, size=size)


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
