"""Model facts parsed from a Hugging Face ``config.json`` and ``generation_config.json``.

Reads both the transformers 5.x spelling (``rope_parameters``) and the older one (top-level
``rope_theta`` + ``rope_scaling``); Mixtral's ``head_dim`` may be null. Only plain JSON is read:
no transformers import, so a worker starts fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shoal.workers.cpu_info import auto_cpu_dtype


class CheckpointConfigError(ValueError):
    """A checkpoint directory whose config cannot be served (missing file, bad field)."""


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` → ``torch.bfloat16``; raises on others."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise CheckpointConfigError(
                f"unsupported dtype {dtype}; use float32, bfloat16 or float16"
            )
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise CheckpointConfigError(
            f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16"
        ) from None


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """The dtype a model is served in: ``dtype``, or for ``"auto"`` bf16 on CUDA and on the
    CPU what ``cpu_info.auto_cpu_dtype`` picks (bf16 where the CPU multiplies it natively)."""
    if dtype != "auto":
        return parse_dtype(dtype)
    return torch.bfloat16 if device.startswith("cuda") else parse_dtype(auto_cpu_dtype())


# "freq_factors": one divisor per rotary frequency, as a GGUF file's rope_freqs tensor holds
# Llama 3's scaling (shoal's own spelling, written into a GGUF view's config.json).
ROPE_TYPES = ("default", "llama3", "freq_factors")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; ``scaling`` holds the llama3 keys or the freq factors when
    ``rope_type`` says so."""

    theta: float = 10000.0
    rope_type: str = "default"
    scaling: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MoeConfig:
    """Sparse-MLP settings of Mixtral / Qwen2-MoE / Qwen3-MoE."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse_layer(self, layer_idx: int) -> bool:
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class CheckpointConfig:
    """What a shoal model definition needs to know about a checkpoint."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    checkpoint_dtype: torch.dtype
    sliding_window: int | None
    moe: MoeConfig | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> CheckpointConfig:
        path = Path(model_dir)
        raw = _read_json(path / "config.json", required=True)
        gen = _read_json(path / "generation_config.json", required=False)
        return cls.from_dicts(raw, gen)

    @classmethod
    def from_dicts(cls, raw: dict[str, Any], gen: dict[str, Any] | None = None) -> CheckpointConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise CheckpointConfigError("config.json has no 'architectures' entry")
        model_type = str(raw.get("model_type", ""))
        hidden = _req(raw, "hidden_size")
        num_heads = _req(raw, "num_attention_heads")
        head_dim = raw.get("head_dim") or hidden // num_heads
        return cls(
            architecture=archs[0],
            model_type=model_type,
            vocab_size=_req(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=int(raw.get("intermediate_size", 4 * hidden)),
            num_layers=_req(raw, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=_parse_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(raw, model_type),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            hidden_act=_hidden_act(raw),
            checkpoint_dtype=parse_dtype(str(raw.get("dtype") or raw.get("torch_dtype") or "fp32")),
            sliding_window=_sliding_window(raw),
            moe=_parse_moe(raw, model_type),
            eos_token_ids=_eos_ids(raw, gen or {}),
            bos_token_id=(gen or {}).get("bos_token_id", raw.get("bos_token_id")),
        )


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.exists():
        if required:
            raise CheckpointConfigError(
                f"{path} not found: not a Hugging Face checkpoint directory"
            )
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointConfigError(f"{path} must hold a JSON object")
    return data


def _req(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or value <= 0:
        raise CheckpointConfigError(
            f"config.json field {key!r} must be a positive integer, got {value!r}"
        )
    return value


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters")
    if not isinstance(params, dict):
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type not in ROPE_TYPES:
        raise CheckpointConfigError(
            f"rope_type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})"
        )
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type", "type")}
    return RopeConfig(
        theta=float(params.get("rope_theta", 10000.0)), rope_type=rope_type, scaling=scaling
    )


def _hidden_act(raw: dict[str, Any]) -> str:
    """The MLP's activation: every supported family gates with SiLU (``silu_and_mul``)."""
    act = str(raw.get("hidden_act") or raw.get("hidden_activation") or "silu")
    if act != "silu":
        raise CheckpointConfigError(f"hidden_act {act!r} is not supported (silu)")
    return act


def _attention_bias(raw: dict[str, Any], model_type: str) -> bool:
    if model_type == "qwen2":
        return True  # Qwen2 always has q/k/v biases
    if model_type == "qwen2_moe":
        return bool(raw.get("qkv_bias", True))
    return bool(raw.get("attention_bias", False))


def _sliding_window(raw: dict[str, Any]) -> int | None:
    if raw.get("use_sliding_window") is False:
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _parse_moe(raw: dict[str, Any], model_type: str) -> MoeConfig | None:
    if model_type == "mixtral":
        return MoeConfig(
            num_experts=int(raw["num_local_experts"]),
            top_k=int(raw.get("num_experts_per_tok", 2)),
            intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
        )
    if model_type in ("qwen2_moe", "qwen3_moe"):
        return MoeConfig(
            num_experts=int(raw.get("num_experts") or raw.get("num_local_experts") or 0),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["moe_intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)
            if model_type == "qwen2_moe"
            else 0,
            decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
        )
    return None


def _eos_ids(raw: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    value = gen.get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
