"""The public kernel API: each op runs its Triton kernel on CUDA (when Triton imports), on the
CPU shoal's C kernel where one serves the inputs (``cpu_pointwise``, ``cpu_decode_attention``,
``cpu_decoder_layers``), and its torch reference otherwise; ``SHOAL_KERNELS=torch|triton``
forces a choice (see ``_backend``).

Conventions: ``T`` tokens in the flattened batch, ``S`` sequences; tensors contiguous unless a
function says otherwise.
"""

from collections.abc import Sequence
from typing import Any

import torch

from shoal.kernels._backend import use_triton
from shoal.kernels.activation import silu_and_mul_torch, silu_and_mul_triton
from shoal.kernels.cpu_decode_attention import CpuDecodePlan, build_cpu_decode_kernel
from shoal.kernels.cpu_decode_step import cpu_decode_step, plan_cpu_decode_step
from shoal.kernels.cpu_decoder_layers import (
    DecoderLayerParts,
    build_decoder_layers_kernel,
    layer_table,
    run_decoder_layers,
)
from shoal.kernels.cpu_pointwise import (
    apply_rotary_cpu,
    build_cpu_pointwise_kernels,
    rms_norm_cpu,
    silu_and_mul_cpu,
    write_kv_cpu,
)
from shoal.kernels.cpu_prefill_attention import build_cpu_prefill_kernel
from shoal.kernels.decode_attention import decode_attention_triton
from shoal.kernels.fused_moe import fused_moe_torch, fused_moe_triton
from shoal.kernels.kv_write import write_kv_torch, write_kv_triton
from shoal.kernels.rms_norm import rms_norm_torch, rms_norm_triton
from shoal.kernels.rotary import apply_rotary_torch, apply_rotary_triton, build_cos_sin_cache
from shoal.kernels.varlen_attention import (
    TorchAttentionPlan,
    plan_varlen_torch,
    varlen_attention_torch,
    varlen_attention_triton,
)

__all__ = [
    "apply_rotary",
    "build_cos_sin_cache",
    "build_cpu_kernels",
    "decode_step",
    "fused_moe",
    "paged_attention",
    "plan_decode_step",
    "plan_paged_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv",
]


def write_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64; slot = block * block_size + offset; < 0 skips
) -> None:
    """Write this step's keys and values into their cache slots, in place."""
    if use_triton(k_cache):
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    elif not write_kv_cpu(key, value, k_cache, v_cache, slot_mapping):
        write_kv_torch(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,  # [T, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [S] int32, context + this step's queries
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    plan: Any = None,
) -> torch.Tensor:  # [T, num_q_heads, head_dim]
    """Causal attention of each sequence's last ``query_len`` positions over its paged context.

    Call ``write_kv`` for this step's tokens first. Pass ``max_query_len``/``max_seq_len`` when
    known to spare a device-to-host read; they must be the true maxima (a smaller
    ``max_seq_len`` truncates the Triton decode's context). ``plan``: what
    ``plan_paged_attention`` returned for this batch (reuse it across layers), or None.

    Torch: the varlen path for any batch (it reads the lengths on the host, so the hints go
    unused). Triton: the decode kernel when every query length is 1, else the varlen kernel.
    """
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
    if not use_triton(q):
        return varlen_attention_torch(*args, plan)
    if max_query_len is None:
        query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
        max_query_len = int(query_lens.max()) if len(seq_lens) else 0
    if max_query_len <= 1:
        decode_args = (q, k_cache, v_cache, block_tables, seq_lens, scale)
        return decode_attention_triton(*decode_args, max_seq_len=max_seq_len)
    return varlen_attention_triton(*args, max_query_len)


def plan_paged_attention(
    q: torch.Tensor,  # [T, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
) -> Any:
    """Work ``paged_attention`` can share across the layers of one step (the torch path's
    split of the batch and its decodes' sparse pattern, valid for every layer whose cache has
    this shape); None where there is none (Triton)."""
    if use_triton(q):
        return None
    return plan_varlen_torch(block_tables, query_start_loc, seq_lens, k_cache, q.shape[1])


def plan_decode_step(
    qkv: torch.Tensor,  # [T, (q heads + 2 kv heads) * head_dim], the fused projection's rows
    positions: torch.Tensor,  # [T] int64
    slot_mapping: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim] = cat(cos, sin)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    num_q_heads: int,
    plan: Any,  # plan_paged_attention's for this step
    *,
    is_neox: bool = True,
) -> Any:
    """A step where ``decode_step`` does a layer's rotary, KV write and attention in one call
    (every token a decode the CPU kernel serves), or None: then ``apply_rotary``, ``write_kv``
    and ``paged_attention`` in turn, which answer the same."""
    if not isinstance(plan, TorchAttentionPlan) or not isinstance(plan.decode, CpuDecodePlan):
        return None
    args = (positions, slot_mapping, cos_sin_cache, k_cache, num_q_heads, is_neox)
    return plan_cpu_decode_step(qkv, plan.decode, bool(plan.seqs), *args)


def decode_step(
    qkv: torch.Tensor,  # as planned
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: Any,  # plan_decode_step's
    scale: float,
) -> torch.Tensor:  # [T, num_q_heads * head_dim]
    """One layer's rotary, KV write and decode attention of a planned step."""
    return cpu_decode_step(qkv, k_cache, v_cache, step, scale)


def plan_decoder_layers(parts: Sequence[DecoderLayerParts], eps: float) -> Any:
    """What ``decoder_layers`` needs of a model's dense layers (made once), or None where the
    one call does not serve them: then each layer's own calls run, which answer the same."""
    return layer_table(parts, eps)


def decoder_layers(
    x: torch.Tensor,  # [T, hidden]: the embedding's rows, overwritten
    table: Any,  # plan_decoder_layers'
    step: Any,  # plan_decode_step's, planned on qkv
    qkv: torch.Tensor,  # [T, qkv width]: scratch for the first layer's q/k/v rows
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (the last layer's output, the residual stream)
    """A decode step's dense layers in one call (where ``plan_decoder_layers`` and
    ``plan_decode_step`` both made a plan)."""
    return run_decoder_layers(x, table, step, qkv, scale)


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
) -> Any:
    """``out`` when residual is None, else ``(out, x + residual)`` with out = norm(x + residual)."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    result = rms_norm_cpu(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual) if result is None else result


def apply_rotary(
    q: torch.Tensor,  # [T, num_q_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim] = cat(cos, sin)
    *,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and k (the inputs are left unchanged)."""
    if use_triton(q):
        return apply_rotary_triton(q, k, positions, cos_sin_cache, is_neox)
    result = apply_rotary_cpu(q, k, positions, cos_sin_cache, is_neox)
    return apply_rotary_torch(q, k, positions, cos_sin_cache, is_neox) if result is None else result


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2 * inter] -> [T, inter]
    """``silu(x[:, :inter]) * x[:, inter:]``."""
    if use_triton(x):
        return silu_and_mul_triton(x)
    result = silu_and_mul_cpu(x)
    return silu_and_mul_torch(x) if result is None else result


def fused_moe(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden], gate rows then up rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [T, top_k] float
    topk_ids: torch.Tensor,  # [T, top_k] int
) -> torch.Tensor:  # [T, hidden]
    """Sum over each token's experts of weight * down(silu(gate(x)) * up(x))."""
    fn = fused_moe_triton if use_triton(x) else fused_moe_torch
    return fn(x, w13, w2, topk_weights, topk_ids)


def build_cpu_kernels() -> bool:
    """Build (or load from the cache) shoal's C kernels for this CPU now, so that no step waits
    for the compiler (a first build takes ~25 s); False where they cannot be built or are off."""
    return (
        build_cpu_decode_kernel()
        and build_cpu_pointwise_kernels()
        and build_decoder_layers_kernel()
        and build_cpu_prefill_kernel()
    )
