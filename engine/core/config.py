"""Scheduler and KV cache configuration, with vLLM's field names and defaults, validated.

``SchedulerConfig`` mirrors ``vllm/config/scheduler.py`` (the fields shoal's scheduler reads);
``CacheConfig`` mirrors ``vllm/config/cache.py``. The number of KV blocks is known only once the
workers have sized their caches: ``CacheConfig.num_gpu_blocks`` is filled in then (or forced by
``num_gpu_blocks_override``). Invalid values raise ``ValueError`` naming the field.

Seams: ``async_scheduling`` is accepted and validated but the scheduler runs one step at a time
(see ``engine.scheduler``); ``num_lookahead_tokens`` is reserved for speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority")
HASH_ALGOS = ("sha256", "xxhash")


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")


@dataclass(slots=True)
class SchedulerConfig:
    """How many tokens and sequences one step may carry, and in what order requests run."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 8192
    max_num_scheduled_tokens: int | None = None  # None: max_num_batched_tokens
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: off; ignored when one request is eligible
    policy: str = "fcfs"
    scheduler_reserve_full_isl: bool = True  # admit only if the whole prompt's blocks fit
    watermark: float = 0.0  # fraction of blocks kept free when admitting waiting requests
    async_scheduling: bool = False  # seam: accepted, not yet used
    num_lookahead_tokens: int = 0  # seam: slots for draft tokens (speculative decoding)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            _require(value >= 1, name, f"must be a positive integer, got {value}")
        if self.max_num_scheduled_tokens is not None:
            _require(
                1 <= self.max_num_scheduled_tokens <= self.max_num_batched_tokens,
                "max_num_scheduled_tokens",
                f"must be in [1, max_num_batched_tokens={self.max_num_batched_tokens}], "
                f"got {self.max_num_scheduled_tokens}",
            )
        _require(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            f"must be non-negative, got {self.long_prefill_token_threshold}",
        )
        _require(
            self.policy in POLICIES, "policy", f"must be fcfs or priority, got {self.policy!r}"
        )
        _require(
            0.0 <= self.watermark < 1.0, "watermark", f"must be in [0, 1), got {self.watermark}"
        )
        _require(
            self.num_lookahead_tokens >= 0,
            "num_lookahead_tokens",
            f"must be non-negative, got {self.num_lookahead_tokens}",
        )
        if not self.enable_chunked_prefill:
            _require(
                self.token_budget >= self.max_model_len,
                "max_num_batched_tokens",
                f"(and max_num_scheduled_tokens) must be at least max_model_len="
                f"{self.max_model_len} when chunked prefill is off, got {self.token_budget}",
            )

    @property
    def token_budget(self) -> int:
        """Tokens one step may schedule."""
        return self.max_num_scheduled_tokens or self.max_num_batched_tokens


@dataclass(slots=True)
class CacheConfig:
    """The paged KV cache: block size, block count and prefix caching."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.92
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    num_gpu_blocks_override: int | None = None
    num_gpu_blocks: int | None = None  # set once the workers have sized their caches

    def __post_init__(self) -> None:
        _require(
            self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            "block_size",
            f"must be a positive power of two, got {self.block_size}",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(
            self.prefix_caching_hash_algo in HASH_ALGOS,
            "prefix_caching_hash_algo",
            f"must be one of {', '.join(HASH_ALGOS)}, got {self.prefix_caching_hash_algo!r}",
        )
        for name in ("num_gpu_blocks_override", "num_gpu_blocks"):
            value = getattr(self, name)
            # Block 0 is the null block, so a usable pool needs at least two.
            _require(value is None or value >= 2, name, f"must be at least 2, got {value}")

    @property
    def resolved_num_blocks(self) -> int:
        """The block count to build the pool with (the override wins)."""
        num_blocks = self.num_gpu_blocks_override or self.num_gpu_blocks
        if num_blocks is None:
            raise ValueError(
                "num_gpu_blocks is not known yet: size the KV cache or set an override"
            )
        return num_blocks
