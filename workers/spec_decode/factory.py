"""The worker's proposer for a ``SpeculativeConfig`` (``make_proposer``)."""

from __future__ import annotations

from shoal.bus.messages.spec_decode import SpeculativeConfig
from shoal.workers.spec_decode.ngram_proposer import NgramProposer
from shoal.workers.spec_decode.proposer import Proposer


def make_proposer(config: SpeculativeConfig, *, max_model_len: int) -> Proposer:
    """The proposer of ``config.speculative_method`` (speculation must be enabled)."""
    method = config.speculative_method
    if method == "ngram":
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        return NgramProposer(
            min_n=config.prompt_lookup_min,
            max_n=config.prompt_lookup_max,
            max_model_len=max_model_len,
        )
    if method == "draft_model":
        raise NotImplementedError("the draft_model proposer is not wired into the worker yet")
    raise ValueError(f"no proposer for speculative_method={method!r}")
