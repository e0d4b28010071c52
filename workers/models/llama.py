"""Llama (incl. Llama 3 rope scaling, tied embeddings) and Mistral: the base decoder as is."""

from __future__ import annotations

from shoal.workers.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Pre-norm GQA decoder with a SwiGLU MLP; optional attention/MLP biases."""


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral's layout equals Llama's (sliding windows are capped by max_model_len instead)."""
