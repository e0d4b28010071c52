"""GGUF tensor names → Hugging Face names, and the Q/K row permutation undone.

llama.cpp names tensors ``blk.<layer>.<part>.<weight|bias>``; MoE experts come stacked in one
tensor per projection (``ffn_gate_exps``: ``[experts, rows, cols]``) or, in older files, one
tensor per expert (``ffn_gate.<expert>``). Its converter permutes the rows of Llama's q/k
projections (``permute``: pairs of rotary halves interleaved) so that ggml can rotate adjacent
pairs; ``unpermute_rows`` restores Hugging Face's order.
"""

from __future__ import annotations

import re

import torch

from shoal.workers.gguf.architectures import Family

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTENTION_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPERT_PROJECTIONS = ("ffn_gate", "ffn_up", "ffn_down")  # (gate, up, down)
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)$")
SKIPPED = frozenset({"rope_freqs.weight"})  # read into the config, not a parameter


def hf_names(name: str, family: Family, num_experts: int) -> list[str] | None:
    """The Hugging Face name(s) of GGUF tensor ``name``: one, or one per expert for a stacked
    expert tensor; None when it is not a parameter."""
    if name in SKIPPED:
        return None
    if top := _TOP_LEVEL.get(name):
        return [top]
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"GGUF tensor {name!r} is not one shoal knows")
    layer, part, expert, kind = m.group(1), m.group(2), m.group(3), m.group(4)
    prefix = f"model.layers.{layer}"
    if part == "ffn_gate_inp":
        return [f"{prefix}.{family.moe_prefix}.gate.{kind}"]
    if part.endswith("_exps"):
        proj = _expert_name(part.removesuffix("_exps"), family)
        return [
            f"{prefix}.{family.moe_prefix}.experts.{e}.{proj}.{kind}" for e in range(num_experts)
        ]
    if expert is not None:  # an older file: one tensor per expert
        proj = _expert_name(part, family)
        return [f"{prefix}.{family.moe_prefix}.experts.{expert}.{proj}.{kind}"]
    hf_part = _ATTENTION_PARTS.get(part)
    if hf_part is None:
        raise KeyError(f"GGUF tensor {name!r} is not one shoal knows")
    return [f"{prefix}.{hf_part}.{kind}"]


def _expert_name(projection: str, family: Family) -> str:
    if projection not in _EXPERT_PROJECTIONS:
        raise KeyError(f"GGUF expert tensor {projection!r} is not one shoal knows")
    return family.expert_names[_EXPERT_PROJECTIONS.index(projection)]


def permuted_heads(hf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """How many heads the converter permuted ``hf_name``'s rows over (q: all heads, k: the KV
    heads), or None for a tensor it left alone."""
    if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return num_heads
    if hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        return num_kv_heads
    return None


def unpermute_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's ``permute``: within each head, rows ``(half, pair)`` back to
    ``(pair, half)`` order."""
    rows = tensor.shape[0]
    head_rows = rows // num_heads
    shaped = tensor.reshape(num_heads, head_rows // 2, 2, *tensor.shape[1:])
    return shaped.transpose(1, 2).reshape(tensor.shape).contiguous()
