"""Mixtral: every layer's MLP is a sparse MoE with renormalised top-k routing. On disk the block
is ``block_sparse_moe`` with experts ``w1``/``w3``/``w2`` (or transformers 5.x fused tensors)."""

from __future__ import annotations

import torch
from torch import nn

from shoal.workers.layers.moe import SparseMoeBlock
from shoal.workers.models.decoder import DecoderForCausalLM
from shoal.workers.parallel import TPContext


class MixtralForCausalLM(DecoderForCausalLM):
    def make_mlp(self, layer_idx: int, tp: TPContext, dtype: torch.dtype, device) -> nn.Module:  # type: ignore[no-untyped-def]
        moe = self.config.moe
        assert moe is not None
        return SparseMoeBlock(
            self.config.hidden_size, moe, None, dtype=dtype, device=device, ep=self.ep
        )

    def rename_checkpoint_tensor(self, name: str) -> str | None:
        return name.replace(".block_sparse_moe.", ".mlp.")
