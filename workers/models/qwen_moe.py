"""Qwen2-MoE (sparse MoE plus a sigmoid-gated shared expert) and Qwen3-MoE (q/k norm, no shared
expert). ``decoder_sparse_step``/``mlp_only_layers`` pick which layers are dense."""

from __future__ import annotations

import torch
from torch import nn

from shoal.workers.layers.moe import SparseMoeBlock
from shoal.workers.models.decoder import DecoderForCausalLM, GatedMLP
from shoal.workers.parallel import TPContext


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    def make_mlp(self, layer_idx: int, tp: TPContext, dtype: torch.dtype, device) -> nn.Module:  # type: ignore[no-untyped-def]
        cfg, moe = self.config, self.config.moe
        assert moe is not None
        if not moe.is_sparse_layer(layer_idx):
            return GatedMLP(
                cfg.hidden_size, cfg.intermediate_size, tp, bias=False, dtype=dtype, device=device
            )
        shared = None
        if moe.shared_expert_intermediate_size:
            shared = GatedMLP(
                cfg.hidden_size,
                moe.shared_expert_intermediate_size,
                tp,
                bias=False,
                dtype=dtype,
                device=device,
            )
        return SparseMoeBlock(cfg.hidden_size, moe, shared, dtype=dtype, device=device, ep=self.ep)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Same block structure; the config carries no shared expert and turns q/k norm on."""
