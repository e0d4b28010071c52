"""The decoder-only transformer every supported family shares: pre-norm layers of GQA attention
(optional q/k/v bias, optional per-head q/k RMSNorm) and a gated MLP or sparse MoE block.

Family files subclass ``DecoderForCausalLM`` to pick the MLP of each layer and to rename
checkpoint tensors; module names mirror Hugging Face's so most names load as they are.

On the CPU a step of decodes over dense layers runs them all in one kernel call
(``ops.decoder_layers``, the same bits as the layers' own calls); ``DecoderModel`` keeps the
layers' table for it (``layers_seen``) and runs the layers one by one wherever it does not serve.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable

import torch
from torch import nn

from shoal.kernels import gemm, ops
from shoal.kernels.cpu_decoder_layers import DecoderLayerParts, LayerTable
from shoal.kernels.strip_gemm import StripCodesWeight, StripWeight
from shoal.workers.config import CheckpointConfig
from shoal.workers.layers.attention import AttentionMetadata, PagedAttention
from shoal.workers.layers.embedding import Embedding, LMHead
from shoal.workers.layers.hookless import HooklessModule
from shoal.workers.layers.linear import (
    ColumnParallelLinear,
    Loaded,
    RowParallelLinear,
    column_linear,
    qkv_linear,
)
from shoal.workers.layers.norm import RMSNorm
from shoal.workers.layers.quantized_tensor import QuantizedTensor
from shoal.workers.layers.rotary import RotaryEmbedding
from shoal.workers.layers.weight_quantizing import dtype_name
from shoal.workers.models.layers_seen import LayersSeen
from shoal.workers.moe.expert_parallel import EPContext
from shoal.workers.parallel import TPContext


class GatedMLP(HooklessModule):
    """down(silu(gate(x)) * up(x)), gate and up fused into one column-parallel projection."""

    def __init__(self, hidden: int, inter: int, tp: TPContext, *, bias: bool, dtype, device):
        super().__init__()
        self.gate_up_proj = column_linear(
            hidden, [inter, inter], tp, bias=bias, dtype=dtype, device=device
        )
        self.down_proj = RowParallelLinear(inter, hidden, tp, bias=bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if isinstance(gate_up, ColumnParallelLinear):  # not wrapped (LoRA): one fused call
            return self.down_proj(gemm.gated_linear(x, gate_up.weight, gate_up.bias))
        return self.down_proj(ops.silu_and_mul(gate_up(x)))


class DecoderAttention(HooklessModule):
    def __init__(
        self, cfg: CheckpointConfig, rotary: RotaryEmbedding, tp: TPContext, *, dtype, device
    ):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.num_heads = tp.divide(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = max(1, cfg.num_kv_heads // tp.size)
        self.qkv_proj = qkv_linear(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            tp,
            bias=cfg.attention_bias,
            dtype=dtype,
            device=device,
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim,
            cfg.hidden_size,
            tp,
            bias=False,
            dtype=dtype,
            device=device,
        )
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.head_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        self.rotary = rotary
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata):  # type: ignore[no-untyped-def]
        qkv = self.qkv_proj(x)  # [T, all heads * head_dim]
        if self.q_norm is None:  # a step of decodes: rotary, K/V write and attention in one call
            step = self.attn.plan_decode_step(qkv, positions, self.rotary.cos_sin_cache, meta)
            if step is not None:
                return self.o_proj(self.attn.decode_step(qkv, step))
        qkv = qkv.reshape(x.shape[0], -1, self.head_dim)  # [T, all heads, head_dim]
        # views [T, heads, head_dim], [T, kv_heads, head_dim] x 2 (one call: each costs ~1 us)
        q, k, v = qkv.split(self.head_split, dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q.contiguous(), k.contiguous(), v, meta))


class DecoderLayer(HooklessModule):
    def __init__(
        self,
        cfg: CheckpointConfig,
        mlp: nn.Module,
        rotary: RotaryEmbedding,
        tp: TPContext,
        *,
        dtype,
        device,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device
        )
        self.self_attn = DecoderAttention(cfg, rotary, tp, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device
        )
        self.mlp = mlp

    def one_call_parts(self) -> DecoderLayerParts | None:
        """This layer as the one-call decode step reads it, or None where it is not a dense
        layer of plain bias-free strip products on one rank (LoRA, torch's int4 kernel, q/k
        norms, MoE, tensor parallel: its own calls run)."""
        products = self.dense_products()
        k_cache, v_cache = self.self_attn.attn.k_cache, self.self_attn.attn.v_cache
        if products is None or k_cache is None or v_cache is None:
            return None
        qkv, o_proj, gate_up, down = (_plain_strip_weight(linear) for linear in products)
        if qkv is None or o_proj is None or gate_up is None or down is None:
            return None
        input_norm, post_norm = self.input_layernorm, self.post_attention_layernorm
        if input_norm.eps != post_norm.eps:
            return None
        return DecoderLayerParts(
            input_norm.weight, qkv, o_proj, post_norm.weight, gate_up, down, k_cache, v_cache
        )

    def dense_products(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module] | None:
        """q/k/v, o, gate/up and down, where the layer is GQA attention without q/k norms and
        a gated MLP (else None)."""
        attn, mlp = self.self_attn, self.mlp
        if attn.q_norm is not None or not isinstance(mlp, GatedMLP):
            return None
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

    def forward(self, positions, x, residual, meta):  # type: ignore[no-untyped-def]
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(HooklessModule):
    def __init__(self, cfg: CheckpointConfig, layers: list[DecoderLayer], *, dtype, device):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(layers)
        self._typed_layers = list(layers)  # the same modules, typed for the one-call step
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self._layers_seen: LayersSeen | None = None  # what the one-call table was made from

    def forward(self, input_ids, positions, meta):  # type: ignore[no-untyped-def]
        x = self.embed_tokens(input_ids)  # [T, hidden]
        in_one_call = self._layers_in_one_call(x, positions, meta)
        if in_one_call is not None:
            x, residual = in_one_call
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    def _layers_in_one_call(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer of a decode step in one kernel call (the same bits as their own calls),
        or None where the layers or the step are not served."""
        table = self._layer_table()
        if table is None:
            return None
        first = self._typed_layers[0].self_attn
        qkv = x.new_empty(x.shape[0], table.parts[0].qkv.out_features)
        step = first.attn.plan_decode_step(qkv, positions, first.rotary.cos_sin_cache, meta)
        if step is None:
            return None
        return ops.decoder_layers(x, table, step, qkv, first.attn.scale)

    def _layer_table(self) -> LayerTable | None:
        """``ops.plan_decoder_layers``' table of the layers as they are now (made again when a
        weight or cache was replaced since), or None."""
        seen = self._layers_seen
        if seen is None or not seen.current():
            seen = self._layers_seen = self._see_layers()
        return seen.table

    def _see_layers(self) -> LayersSeen:
        layers = self._typed_layers
        attentions = tuple((a, a.k_cache, a.v_cache) for a in (x.self_attn.attn for x in layers))
        eps = layers[0].input_layernorm.eps
        parts = []
        for layer in layers:
            layer_parts = layer.one_call_parts()
            if layer_parts is None or layer.input_layernorm.eps != eps:
                return LayersSeen(None, (), attentions)
            parts.append(layer_parts)
        table = ops.plan_decoder_layers(parts, eps)
        linears = [linear for layer in layers for linear in layer.dense_products() or ()]
        watched = tuple((linear, linear.weight) for linear in linears) if table else ()
        return LayersSeen(table, watched, attentions)


def _plain_strip_weight(linear: nn.Module) -> StripWeight | StripCodesWeight | None:
    """A linear's packed weight (floats or codes) where it is a plain bias-free strip product
    on one rank."""
    plain = type(linear) in (ColumnParallelLinear, RowParallelLinear)
    weight = getattr(linear, "weight", None)
    if not plain or linear.bias is not None or linear.tp.size != 1:
        return None
    return weight if isinstance(weight, StripWeight | StripCodesWeight) else None


# checkpoint part name -> (our fused parameter part, shard id)
_STACKED = [
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
]
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PART = {
    "gate_proj": ("w13", 0),
    "w1": ("w13", 0),
    "up_proj": ("w13", 1),
    "w3": ("w13", 1),
    "down_proj": ("w2", None),
    "w2": ("w2", None),
}
_FUSED_EXPERT = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


class DecoderForCausalLM(HooklessModule):
    """Base of every family: ``forward`` → final hidden states; ``compute_logits`` → fp32."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        tp: TPContext,
        *,
        dtype: torch.dtype,
        device,
        max_positions: int,
        ep: EPContext | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.ep = ep  # spreads the experts of every sparse MLP (``make_mlp``); None: all here
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, device=device)
        layers = [
            DecoderLayer(
                cfg, self.make_mlp(i, tp, dtype, device), rotary, tp, dtype=dtype, device=device
            )
            for i in range(cfg.num_layers)
        ]
        self.model = DecoderModel(cfg, layers, dtype=dtype, device=device)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(
            cfg.vocab_size, cfg.hidden_size, tied_to=tied, dtype=dtype, device=device
        )
        # What loading made of the linear weights (``layers.weight_quantizing``'s summary).
        self.linear_weights = dtype_name(dtype)

    def make_mlp(self, layer_idx: int, tp: TPContext, dtype, device) -> nn.Module:  # type: ignore[no-untyped-def]
        cfg = self.config
        return GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            tp,
            bias=cfg.mlp_bias,
            dtype=dtype,
            device=device,
        )

    def attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.modules() if isinstance(m, PagedAttention)]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden]
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [N, vocab] fp32
        return self.lm_head(hidden_states)

    def rename_checkpoint_tensor(self, name: str) -> str | None:
        """Family hook: map a checkpoint tensor name to this module tree (None = skip)."""
        return name

    def resolve_tensor(self, name: str) -> tuple[str, Hashable] | None:
        """Checkpoint name → (parameter name, shard id), or None for a tensor to skip."""
        renamed = self.rename_checkpoint_tensor(name)
        if renamed is None or _IGNORED.search(renamed):
            return None
        if self.config.tie_word_embeddings and renamed == "lm_head.weight":
            return None
        if m := _EXPERT.match(renamed):
            target, part = _EXPERT_PART[m.group(3)]
            return f"{m.group(1)}.{target}", (int(m.group(2)), part)
        if m := _FUSED_EXPERT.match(renamed):
            target = "w13" if m.group(2) == "gate_up_proj" else "w2"
            return f"{m.group(1)}.{target}", None
        for ours, fused, shard_id in _STACKED:
            if ours in renamed:
                return renamed.replace(ours, fused), shard_id
        return renamed, None

    def load_weights(self, tensors: Iterable[tuple[str, Loaded]]) -> dict[str, set]:
        """Load checkpoint tensors; returns the shard ids loaded per parameter (the loader
        checks completeness). A quantized tensor reaches a parameter that can keep it
        (``quantized_parts``: linear weights, the embedding) as it is, any other dequantized.
        Raises KeyError naming a tensor that fits no parameter."""
        params = dict(self.named_parameters())
        loaded: dict[str, set] = {}
        for name, tensor in tensors:
            resolved = self.resolve_tensor(name)
            if resolved is None:
                continue
            target, shard_id = resolved
            param = params.get(target)
            if param is None:
                raise KeyError(
                    f"checkpoint tensor {name!r} matches no parameter of "
                    f"{type(self).__name__} (looked for {target!r})"
                )
            if isinstance(tensor, QuantizedTensor) and not hasattr(param, "quantized_parts"):
                tensor = tensor.dequantize()
            try:
                param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
            except (ValueError, RuntimeError, IndexError) as exc:
                raise ValueError(f"checkpoint tensor {name!r}: {exc}") from exc
            loaded.setdefault(target, set()).add(shard_id)
        return loaded
