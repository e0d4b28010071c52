"""Token embedding and LM head, replicated on every tensor-parallel rank (vocabularies of the
models served here are small next to the layers; sharding them is a later step).

The embedding looks rows up in a float weight, whatever the checkpoint stored: a quantized
checkpoint tensor (``QuantizedTensor``) is dequantized into it and also kept in its
``quantized_parts``, so that a tied LM head can multiply by a quantized copy
(``layers.weight_quantizing``), as llama.cpp does.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from shoal.kernels import gemm
from shoal.kernels.gemm import PreparedWeight
from shoal.workers.layers.hookless import HooklessModule
from shoal.workers.layers.linear import (
    Loaded,
    _plain_loader,
    copy_checked,
    make_param,
    replace_weight,
)
from shoal.workers.layers.quantized_tensor import QuantizedTensor


def _embedding_loader(param: nn.Parameter, loaded: Loaded, shard_id: Hashable = None) -> None:
    if isinstance(loaded, QuantizedTensor):
        param.quantized_parts.put(0, loaded)  # type: ignore[attr-defined]
        loaded = loaded.dequantize()
    copy_checked(param.data, loaded, "embedding")


class Embedding(HooklessModule):
    def __init__(self, vocab_size: int, hidden: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = make_param(
            (vocab_size, hidden), dtype, device, _embedding_loader, quantizable=True
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return F.embedding(input_ids, self.weight)


class LMHead(HooklessModule):
    """Hidden states → fp32 logits; shares the embedding's weight when tied."""

    weight: torch.Tensor | PreparedWeight

    def __init__(
        self, vocab_size: int, hidden: int, *, tied_to: Embedding | None, dtype, device
    ) -> None:
        super().__init__()
        self.tied_to = tied_to
        if tied_to is None:
            self.weight = make_param(
                (vocab_size, hidden), dtype, device, _plain_loader, quantizable=True
            )

    def head_weight(self) -> torch.Tensor | PreparedWeight:  # [vocab, hidden]
        """The weight multiplied by: its own (loaded, or a copy given by ``use_weight``), else
        the embedding's."""
        own = getattr(self, "weight", None)
        if own is not None:
            return own
        assert self.tied_to is not None
        return self.tied_to.weight

    def use_weight(self, weight: torch.Tensor | PreparedWeight) -> None:
        """Multiply by ``weight`` (the head's weight repacked or quantized) from now on; a tied
        head gets its own copy and the embedding keeps the weight it looks rows up in."""
        replace_weight(self, weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        return gemm.linear(hidden_states, self.head_weight()).float()
