"""An adapter's tensors for this worker: read from its PEFT files, each LoRA pair matched to
the model's wrapped layer and part (``model.resolve_tensor``, as a checkpoint's weights are),
cut to this tensor-parallel rank's share, in the model's dtype, with B scaled."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from shoal.config.peft_adapter import (
    WEIGHTS_FILE,
    LoRAAdapterError,
    PeftAdapterConfig,
    check_tensor,
    read_config,
    read_safetensors_header,
)
from shoal.workers.lora.layers import LoRAColumnLinear, LoRALayer, LoRALayers, PartWeights
from shoal.workers.models.decoder import DecoderForCausalLM


@dataclass(frozen=True)
class LoadedAdapter:
    lora_int_id: int
    modules: dict[str, dict[Hashable, PartWeights]]  # wrapped layer path -> part -> weights
    num_bytes: int


def load_adapter(
    folder: Path,
    lora_int_id: int,
    model: DecoderForCausalLM,
    layers: LoRALayers,
    *,
    max_lora_rank: int,
    dtype: torch.dtype,
) -> LoadedAdapter:
    """The adapter in ``folder`` for this rank; ``LoRAAdapterError`` naming what is wrong."""
    config = read_config(folder)
    path = folder / WEIGHTS_FILE
    read_safetensors_header(path)  # a clear error for a truncated file first
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAAdapterError(f"{path}: cannot be read ({exc})") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        spec = check_tensor(name, tuple(tensor.shape), max_lora_rank, model.config.num_layers)
        pairs.setdefault(spec.module, {})[spec.which] = tensor
    modules: dict[str, dict[Hashable, PartWeights]] = {}
    num_bytes = 0
    for module, pair in pairs.items():
        layer_path, part, weights = _part_weights(module, pair, config, model, layers, dtype)
        modules.setdefault(layer_path, {})[part] = weights
        num_bytes += weights.a.nbytes + weights.b.nbytes
    return LoadedAdapter(lora_int_id=lora_int_id, modules=modules, num_bytes=num_bytes)


def _part_weights(
    module: str,
    pair: dict[str, torch.Tensor],
    config: PeftAdapterConfig,
    model: DecoderForCausalLM,
    layers: LoRALayers,
    dtype: torch.dtype,
) -> tuple[str, Hashable, PartWeights]:
    if set(pair) != {"lora_A", "lora_B"}:
        raise LoRAAdapterError(
            f"target module {module!r} has {sorted(pair)}: needs lora_A and lora_B"
        )
    a, b = pair["lora_A"], pair["lora_B"]
    if a.shape[0] != b.shape[1]:
        raise LoRAAdapterError(
            f"target module {module!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
            "disagree on the rank"
        )
    resolved = model.resolve_tensor(f"{module}.weight")
    layer = layers.layers.get(resolved[0].removesuffix(".weight")) if resolved else None
    if resolved is None or layer is None:
        raise LoRAAdapterError(f"target module {module!r}: the model has no such layer")
    part = resolved[1]
    if part is None and len(layer.parts) == 1:
        part = layer.parts[0]
    a, b = _this_rank(layer, part, a, b, module)
    scale = config.scaling(module, int(a.shape[0]))
    weights = PartWeights(
        a=a.to(dtype).contiguous(), b=(b.to(torch.float32) * scale).to(dtype).contiguous()
    )
    return resolved[0].removesuffix(".weight"), part, weights


def _this_rank(
    layer: LoRALayer, part: Hashable, a: torch.Tensor, b: torch.Tensor, module: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B cut as the base weight is: B's rows of a column-parallel part, A's input
    columns of a row-parallel layer."""
    if isinstance(layer, LoRAColumnLinear):
        rows, first, full = layer.base.shard_sizes[part]
        in_features = int(layer.lora_a.shape[-1])
        if b.shape[0] != full or a.shape[1] != in_features:
            raise LoRAAdapterError(
                f"target module {module!r}: lora_A {list(a.shape)} / lora_B {list(b.shape)} "
                f"do not fit the layer ({in_features} in, {full} out)"
            )
        return a, b.narrow(0, first, rows)
    base = layer.base
    in_per_rank = int(layer.lora_a.shape[-1])
    full_in = in_per_rank * base.tp.size
    if a.shape[1] != full_in or b.shape[0] != layer.lora_b.shape[1]:
        raise LoRAAdapterError(
            f"target module {module!r}: lora_A {list(a.shape)} / lora_B {list(b.shape)} "
            f"do not fit the layer ({full_in} in, {layer.lora_b.shape[1]} out)"
        )
    return a.narrow(1, base.tp.rank * in_per_rank, in_per_rank), b
