"""Qwen2: Llama's layout with q/k/v biases (``CheckpointConfig.attention_bias`` is forced on)."""

from __future__ import annotations

from shoal.workers.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Pre-norm GQA decoder, q/k/v projections with bias."""
