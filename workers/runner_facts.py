"""What a ``ModelRunner`` reports: ``ModelFacts`` once loaded (for the worker's
``WorkerInfo``), ``StepTimings`` after each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelFacts:
    """What ``load`` learned, for the worker's ``WorkerInfo``."""

    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_layers: int = 0  # this rank's KV cache geometry (``WorkerInfo``'s, for KV offload)
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_dtype: str = ""
    total_kv_heads: int = 0  # the model's
    # What loading made of the linear weights, e.g. "Q4_1 as int4 (group 32): 120, Q8_0 as
    # int8 (per channel): 1" (``layers.weight_quantizing``).
    linear_weights: str = ""


@dataclass
class StepTimings:
    """Seconds spent in the last ``execute``: building inputs, model forward, sampling."""

    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
