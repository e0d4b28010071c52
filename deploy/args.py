"""Engine arguments in vLLM's spelling, shared by the CLI, the offline ``LLM`` and the actors.

One frozen dataclass validated on construction; ``to_json``/``from_json`` carry it to actor
processes started by the supervisor.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPES = ("auto", "float32", "float16", "bfloat16")
BUS_KINDS = ("nats", "memory")


@dataclass(frozen=True, slots=True)
class EngineArgs:
    model: str
    served_model_name: str | None = None
    dtype: str = "auto"  # "auto" serves fp32 on the CPU (fast matmuls there) and bf16 on CUDA
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes of KV cache per worker
    num_gpu_blocks_override: int | None = None
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    seed: int = 0
    max_waiting_requests: int = 1024  # past this an engine core answers "overloaded"
    scheduling_policy: str = "fcfs"
    nats_url: str | None = None
    bus: str = "nats"
    namespace: str = "shoal"
    device: str = "cpu"
    step_timeout_s: float = 120.0  # a worker step taking longer than this counts as failed

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineArgs:
        return cls(**json.loads(text))


def _positive(args: EngineArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")


def _validate(args: EngineArgs) -> None:
    if not Path(args.model).is_dir():
        raise ValueError(f"model directory not found: {args.model}")
    if args.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if args.bus not in BUS_KINDS:
        raise ValueError(f"bus must be one of {', '.join(BUS_KINDS)}, got {args.bus!r}")
    if args.scheduling_policy not in ("fcfs", "priority"):
        raise ValueError(
            f"scheduling_policy must be fcfs or priority, got {args.scheduling_policy!r}"
        )
    _positive(
        args,
        "max_model_len",
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "kv_cache_memory",
        "num_gpu_blocks_override",
        "data_parallel_size",
        "tensor_parallel_size",
        "max_waiting_requests",
    )
    if args.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
        raise ValueError(f"block_size must be a power of two up to 128, got {args.block_size}")
    if args.bus == "memory" and args.tensor_parallel_size > 1:
        raise ValueError(
            "tensor_parallel_size > 1 runs one worker process per rank, which the in-memory "
            "bus cannot reach: use the NATS bus"
        )
    if args.seed < 0:
        raise ValueError(f"seed must be non-negative, got {args.seed}")
