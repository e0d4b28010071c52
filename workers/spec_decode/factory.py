"""The worker's proposer for its configuration's ``speculative_config`` (``make_proposer``),
and the KV bytes per block it adds to the worker's budget (``proposer_bytes_per_block``)."""

from __future__ import annotations

import torch

from shoal.config.deployment import ShoalConfig
from shoal.workers.spec_decode.draft_model import DraftModelProposer, draft_bytes_per_block
from shoal.workers.spec_decode.ngram_proposer import NgramProposer
from shoal.workers.spec_decode.proposer import Proposer


def proposer_bytes_per_block(config: ShoalConfig, dtype: torch.dtype) -> int:
    """KV bytes per block of the proposer's own cache (a draft model's; 0 for n-gram)."""
    if config.speculative_config.speculative_method == "draft_model":
        return draft_bytes_per_block(config, dtype)
    return 0


def make_proposer(
    config: ShoalConfig,
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    vocab_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Proposer:
    """The loaded proposer of ``speculative_config.speculative_method`` (speculation on)."""
    spec = config.speculative_config
    method = spec.speculative_method
    if method == "ngram":
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        return NgramProposer(
            min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max, max_model_len=max_model_len
        )
    if method == "draft_model":
        proposer = DraftModelProposer(
            config,
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            device=device,
            dtype=dtype,
        )
        proposer.load()
        return proposer
    raise ValueError(f"no proposer for speculative_method={method!r}")
