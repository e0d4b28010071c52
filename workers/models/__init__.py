"""Model definitions, one file per family, and the registry from HF architecture names."""

from __future__ import annotations

from shoal.workers.models.decoder import DecoderForCausalLM
from shoal.workers.models.llama import LlamaForCausalLM, MistralForCausalLM
from shoal.workers.models.mixtral import MixtralForCausalLM
from shoal.workers.models.qwen2 import Qwen2ForCausalLM
from shoal.workers.models.qwen3 import Qwen3ForCausalLM
from shoal.workers.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

# architectures whose MLPs are sparse: tensor parallelism is offered for dense models only
MOE_ARCHITECTURES = frozenset({"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture shoal has no model definition for."""


def model_class_for(architecture: str) -> type[DecoderForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: {supported}"
        ) from None


__all__ = ["MODEL_REGISTRY", "MOE_ARCHITECTURES", "UnsupportedArchitectureError", "model_class_for"]
