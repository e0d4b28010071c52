"""What decides the demo checkpoint (its cache key); free of heavy imports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class DemoSpec:
    """Everything that decides the demo checkpoint's bytes (part of its cache key)."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4  # head_dim 64
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    seq_len: int = 64
    batch_size: int = 16
    train_steps: int = 400
    learning_rate: float = 3e-3
    seed: int = 0
