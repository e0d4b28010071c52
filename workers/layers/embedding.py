"""Token embedding and LM head, replicated on every tensor-parallel rank (vocabularies of the
models served here are small next to the layers; sharding them is a later step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.kernels import gemm
from shoal.workers.layers.linear import _plain_loader, make_param


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = make_param((vocab_size, hidden), dtype, device, _plain_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Hidden states → fp32 logits; shares the embedding's weight when tied."""

    def __init__(
        self, vocab_size: int, hidden: int, *, tied_to: Embedding | None, dtype, device
    ) -> None:
        super().__init__()
        self.tied_to = tied_to
        if tied_to is None:
            self.weight = make_param((vocab_size, hidden), dtype, device, _plain_loader)

    def head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        own = self._parameters.get("weight")
        if own is not None:
            return own
        assert self.tied_to is not None
        return self.tied_to.weight

    def use_weight(self, weight: torch.Tensor) -> None:
        """Multiply by ``weight`` (the head's weight repacked) from now on; a tied head gets
        its own copy and the embedding keeps the weight it looks rows up in."""
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        return gemm.linear(hidden_states, self.head_weight()).float()
