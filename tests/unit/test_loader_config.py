"""``CheckpointConfig`` parsing: both rope spellings, null head_dim, MoE fields, eos ids."""

from __future__ import annotations

import pytest
import torch

from shoal.workers.config import CheckpointConfig, CheckpointConfigError, parse_dtype

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_rope_parameters_of_transformers_5():
    raw = {
        **BASE,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    cfg = CheckpointConfig.from_dicts(raw)
    assert cfg.rope.theta == 5e5 and cfg.rope.rope_type == "llama3"
    assert cfg.rope.scaling["factor"] == 8.0
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16


def test_older_rope_theta_and_rope_scaling():
    raw = {
        **BASE,
        "rope_theta": 1e6,
        "rope_scaling": {
            "type": "llama3",
            "factor": 2.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }
    cfg = CheckpointConfig.from_dicts(raw)
    assert cfg.rope.theta == 1e6 and cfg.rope.rope_type == "llama3"


def test_unsupported_activation():
    """An MLP activation the models do not implement is refused, never silently replaced."""
    with pytest.raises(CheckpointConfigError, match="gelu_pytorch_tanh"):
        CheckpointConfig.from_dicts({**BASE, "hidden_act": "gelu_pytorch_tanh"})
    assert CheckpointConfig.from_dicts({**BASE, "hidden_act": "silu"}).hidden_act == "silu"


def test_unsupported_rope_type():
    with pytest.raises(CheckpointConfigError, match="yarn"):
        CheckpointConfig.from_dicts({**BASE, "rope_parameters": {"rope_type": "yarn"}})


def test_mixtral_null_head_dim_and_moe():
    raw = {
        **BASE,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "head_dim": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    cfg = CheckpointConfig.from_dicts(raw, {"eos_token_id": [2, 7]})
    assert cfg.head_dim == 16
    assert cfg.moe is not None and cfg.moe.num_experts == 8 and cfg.moe.norm_topk_prob
    assert cfg.eos_token_ids == (2, 7)


def test_qwen_moe_sparse_layers():
    raw = {
        **BASE,
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    cfg = CheckpointConfig.from_dicts(raw)
    assert cfg.moe is not None and cfg.attention_bias
    assert [cfg.moe.is_sparse_layer(i) for i in range(4)] == [False, True, False, False]


def test_bad_field_is_named():
    with pytest.raises(CheckpointConfigError, match="hidden_size"):
        CheckpointConfig.from_dicts({**BASE, "hidden_size": "big"})


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    with pytest.raises(CheckpointConfigError, match="int8"):
        parse_dtype("int8")
