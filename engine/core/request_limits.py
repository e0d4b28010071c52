"""Checks that a request, or the scheduler's budget, could ever run: raised as ``ValueError``
when a request is added (or the scheduler built), never discovered as a request that waits or
preempts itself forever."""

from __future__ import annotations

from shoal.config.deployment import SchedulerConfig
from shoal.engine.core.request import Request


def check_fits(
    request: Request, *, max_model_len: int, num_blocks: int, block_size: int, reserved: int
) -> None:
    """A request that could not run even alone would wait (or preempt itself) forever."""
    max_total = min(max_model_len, request.num_prompt_tokens + request.max_tokens)
    if -(-max_total // block_size) > num_blocks - 1:
        raise ValueError(
            f"request needs up to {max_total} tokens of KV cache, more than the "
            f"{(num_blocks - 1) * block_size} the cache holds"
        )
    num_prompt_blocks = -(-request.num_prompt_tokens // block_size)
    if num_prompt_blocks > num_blocks - 1 - reserved:
        raise ValueError(
            f"prompt needs {num_prompt_blocks} KV blocks, more than the "
            f"{num_blocks - 1 - reserved} admission may use (watermark)"
        )


def check_token_budget(config: SchedulerConfig, max_model_len: int) -> None:
    """Without chunked prefill a whole prompt must fit in one step."""
    if not config.enable_chunked_prefill and config.token_budget < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens (and max_num_scheduled_tokens) must be at least "
            f"max_model_len={max_model_len} when chunked prefill is off, got {config.token_budget}"
        )
