"""The GGUF architectures shoal serves and the Hugging Face config each one becomes.

llama.cpp names an architecture (``general.architecture``) and keeps its hyper-parameters under
``<arch>.*`` keys; Mistral and Mixtral files say ``llama`` (Mixtral with experts). Each entry
says which Hugging Face family the file is, whether the converter permuted the Q/K rows (the
families with interleaved rotary pairs: Llama's), and how the family names its MoE tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal.workers.gguf.errors import GGUFError


@dataclass(frozen=True)
class Family:
    """One Hugging Face family a GGUF architecture maps to."""

    architecture: str  # config.json's architectures[0]
    model_type: str
    permuted_qk: bool  # llama.cpp's converter permuted q/k rows (undone at load)
    moe_prefix: str = "mlp"  # the sparse MLP's module: "mlp" or Mixtral's "block_sparse_moe"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


LLAMA = Family("LlamaForCausalLM", "llama", permuted_qk=True)
MIXTRAL = Family(
    "MixtralForCausalLM",
    "mixtral",
    permuted_qk=True,
    moe_prefix="block_sparse_moe",
    expert_names=("w1", "w3", "w2"),
)
FAMILIES: dict[str, Family] = {
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
    "qwen2moe": Family("Qwen2MoeForCausalLM", "qwen2_moe", permuted_qk=False),
    "qwen3moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", permuted_qk=False),
}
SUPPORTED_ARCHITECTURES = ("llama", *FAMILIES)


def family_of(arch: str, metadata: dict[str, Any]) -> Family:
    """The family of a file whose ``general.architecture`` is ``arch``."""
    if arch == "llama":
        return MIXTRAL if int(metadata.get("llama.expert_count") or 0) > 0 else LLAMA
    family = FAMILIES.get(arch)
    if family is None:
        raise GGUFError(
            f"architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return family


def hf_config(
    arch: str, family: Family, metadata: dict[str, Any], facts: dict[str, Any]
) -> dict[str, Any]:
    """config.json for the file: its hyper-parameters, and ``facts`` read from its tensors
    (``vocab_size``, ``tie_word_embeddings``, ``attention_bias``, ``dense_layers``,
    ``rope_freq_factors``, ``torch_dtype``)."""

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"metadata {arch}.{key} is missing")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": facts["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", 0)) or 4 * hidden,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": _per_layer_constant(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rope_parameters": _rope(arch, metadata, facts.get("rope_freq_factors")),
        "tie_word_embeddings": facts["tie_word_embeddings"],
        "attention_bias": facts["attention_bias"],
        "hidden_act": "silu",
        "torch_dtype": facts["torch_dtype"],
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
    }
    config.update(_moe(arch, family, metadata, facts["dense_layers"]))
    return config


def _per_layer_constant(value: Any) -> int:
    """A count that GGUF may store per layer (an array): shoal needs it equal on every layer."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFError(f"a per-layer head count that varies ({sorted(set(value))})")
        value = value[0]
    return int(value)


def _rope(arch: str, metadata: dict[str, Any], freq_factors: list[float] | None) -> dict:
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"rope scaling {scaling!r} is not supported (none, or rope_freqs)")
    theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    if freq_factors is None:
        return {"rope_type": "default", "rope_theta": theta}
    # Llama 3's scaling, as llama.cpp's converter stores it: one divisor per frequency.
    return {"rope_type": "freq_factors", "rope_theta": theta, "freq_factors": freq_factors}


def _moe(
    arch: str, family: Family, metadata: dict[str, Any], dense_layers: list[int]
) -> dict[str, Any]:
    experts = int(metadata.get(f"{arch}.expert_count") or 0)
    if experts == 0:
        return {}
    top_k = int(metadata.get(f"{arch}.expert_used_count") or 2)
    if family.model_type == "mixtral":
        if dense_layers:
            raise GGUFError(f"Mixtral layers without experts ({dense_layers})")
        return {"num_local_experts": experts, "num_experts_per_tok": top_k}
    moe: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(metadata[f"{arch}.expert_feed_forward_length"]),
        # llama.cpp normalises Qwen3-MoE's top-k weights and not Qwen2-MoE's.
        "norm_topk_prob": bool(metadata.get(f"{arch}.expert_weights_norm", arch == "qwen3moe")),
        "mlp_only_layers": dense_layers,
    }
    shared = metadata.get(f"{arch}.expert_shared_feed_forward_length")
    if shared:
        moe["shared_expert_intermediate_size"] = int(shared)
    return moe
