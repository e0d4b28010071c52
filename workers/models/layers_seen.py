"""What a model's one-call layer table (``ops.plan_decoder_layers``) was made from: each dense
layer's linear modules with the weight each held, and each attention layer with the caches it
held. A step takes the table while all of them are still the same objects (plain attributes,
read in microseconds for the whole model: rebuilding the table cost ~1 ms a step on SmolLM2),
and builds it again once a weight or cache was replaced."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shoal.kernels.cpu_decoder_layers import LayerTable
from shoal.workers.layers.attention import PagedAttention


@dataclass(frozen=True)
class LayersSeen:
    table: LayerTable | None  # None: the layers' own calls run
    linears: tuple[tuple[nn.Module, object], ...]  # (linear, its weight then); with a table
    attentions: tuple[tuple[PagedAttention, torch.Tensor | None, torch.Tensor | None], ...]

    def current(self) -> bool:
        """Whether every weight and cache is still the one the table was made from."""
        for attention, k_cache, v_cache in self.attentions:
            if attention.k_cache is not k_cache or attention.v_cache is not v_cache:
                return False
        return all(linear.weight is weight for linear, weight in self.linears)
