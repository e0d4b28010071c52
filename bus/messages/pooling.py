"""A request that asks for its prompt's pooled hidden state instead of new tokens (embeddings:
vLLM's pooling runner). ``pooling_type``: ``LAST`` (the last prompt token's state), ``MEAN``
(their mean) or ``CLS`` (the first token's); ``normalize``: scaled to unit length."""

from __future__ import annotations

import msgspec

POOLING_TYPES = ("LAST", "MEAN", "CLS")


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
