"""Qwen3: per-head RMSNorm on q and k before rotary (``CheckpointConfig.qk_norm``), no qkv bias."""

from __future__ import annotations

from shoal.workers.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Pre-norm GQA decoder with q/k norm and an explicit head_dim."""
