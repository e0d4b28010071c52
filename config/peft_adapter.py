"""What a LoRA adapter's files say, read without torch (PEFT's format: ``adapter_config.json``
beside ``adapter_model.safetensors``), and the checks every reader of them shares.

The gateway checks an adapter this way before it serves it (a clean 400 naming the problem);
each worker reads the tensors themselves (``workers.lora.adapter``) and checks them against the
model it holds. Both name a problem with ``LoRAAdapterError``.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import msgspec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections of the decoder families shoal serves that an adapter may target, by PEFT's
# module names.
TARGETABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)\.(?P<which>lora_A|lora_B)(?:\.default)?\.weight$"
)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MAX_HEADER = 100 << 20


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served, and why (the API answers 400 with it)."""


class PeftAdapterConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The fields of PEFT's ``LoraConfig`` that decide what the adapter computes."""

    r: int = 8
    lora_alpha: float = 8.0
    target_modules: list[str] | str | None = None
    use_rslora: bool = False
    use_dora: bool = False
    bias: str = "none"
    modules_to_save: list[str] | None = None
    alpha_pattern: dict[str, float] = {}
    rank_pattern: dict[str, int] = {}
    base_model_name_or_path: str | None = None
    peft_type: str = "LORA"

    def alpha_for(self, module: str) -> float:
        """The module's alpha: the longest ``alpha_pattern`` key naming it, else ``lora_alpha``
        (PEFT matches a key against the module name's end)."""
        for key in sorted(self.alpha_pattern, key=len, reverse=True):
            if re.match(rf"(.*\.)?{key}$", module):
                return float(self.alpha_pattern[key])
        return float(self.lora_alpha)

    def scaling(self, module: str, rank: int) -> float:
        alpha = self.alpha_for(module)
        return alpha / rank**0.5 if self.use_rslora else alpha / rank


class AdapterTensor(msgspec.Struct, frozen=True):
    module: str  # PEFT's module name without its prefix: model.layers.0.self_attn.q_proj
    which: str  # lora_A | lora_B
    shape: tuple[int, ...]


def read_config(folder: Path) -> PeftAdapterConfig:
    if not folder.is_dir():
        raise LoRAAdapterError(f"{folder}: no such adapter folder")
    path = folder / CONFIG_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise LoRAAdapterError(f"{folder}: no {CONFIG_FILE} (not a PEFT adapter)") from exc
    except OSError as exc:
        raise LoRAAdapterError(f"{path}: cannot be read ({exc.strerror})") from exc
    try:
        config = msgspec.json.decode(raw, type=PeftAdapterConfig)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LoRAAdapterError(f"{path}: not a valid adapter config ({exc})") from exc
    _check_config(config, path)
    return config


def _check_config(config: PeftAdapterConfig, path: Path) -> None:
    if config.peft_type.upper() != "LORA":
        raise LoRAAdapterError(f"{path}: peft_type {config.peft_type!r} is not LORA")
    if config.use_dora:
        raise LoRAAdapterError(f"{path}: DoRA adapters (use_dora) are not supported")
    if config.bias != "none":
        raise LoRAAdapterError(f"{path}: bias={config.bias!r} is not supported (only 'none')")
    if config.modules_to_save:
        raise LoRAAdapterError(
            f"{path}: modules_to_save {config.modules_to_save} are not supported "
            "(the adapter would replace whole layers)"
        )


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a safetensors file's header; checks that the data
    the header describes is all there."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LoRAAdapterError(f"{path}: truncated (no safetensors header)")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER:
                raise LoRAAdapterError(f"{path}: not a safetensors file (header of {length} B)")
            header = json.loads(f.read(length))
            size = path.stat().st_size
    except FileNotFoundError as exc:
        raise LoRAAdapterError(f"{path.parent}: no {path.name}") from exc
    except OSError as exc:
        raise LoRAAdapterError(f"{path}: cannot be read ({exc.strerror})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"{path}: corrupt safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise LoRAAdapterError(f"{path}: corrupt safetensors header (not a JSON object)")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (_, stop) = info["dtype"], info["shape"], info["data_offsets"]
            tensors[name] = (str(dtype), tuple(int(n) for n in shape))
            end = max(end, int(stop))
        except (KeyError, TypeError, ValueError) as exc:
            raise LoRAAdapterError(f"{path}: corrupt entry for tensor {name!r}") from exc
    if 8 + length + end > size:
        raise LoRAAdapterError(
            f"{path}: truncated ({size} B, the header describes {8 + length + end} B)"
        )
    return tensors


def parse_tensor_name(name: str) -> AdapterTensor | None:
    """PEFT's tensor name -> module and A/B; None for a name that is not a LoRA weight."""
    m = _TENSOR.match(name)
    if m is None:
        return None
    return AdapterTensor(module=m.group("module"), which=m.group("which"), shape=())


def check_adapter(
    folder: str | Path, *, max_lora_rank: int, num_layers: int | None = None
) -> PeftAdapterConfig:
    """The adapter's config once its files are readable, every tensor is a LoRA A or B of a
    projection shoal's models have (in a layer the model has), and no rank is above
    ``max_lora_rank``; else ``LoRAAdapterError`` naming the first problem."""
    folder = Path(folder)
    config = read_config(folder)
    header = read_safetensors_header(folder / WEIGHTS_FILE)
    if not header:
        raise LoRAAdapterError(f"{folder / WEIGHTS_FILE}: holds no tensors")
    for name, (_, shape) in header.items():
        check_tensor(name, shape, max_lora_rank, num_layers)
    return config


def check_tensor(
    name: str, shape: tuple[int, ...], max_lora_rank: int, num_layers: int | None
) -> AdapterTensor:
    """One tensor of an adapter, named and shaped as a LoRA weight shoal can apply."""
    tensor = parse_tensor_name(name)
    if tensor is None:
        raise LoRAAdapterError(f"tensor {name!r} is not a LoRA weight (lora_A / lora_B)")
    leaf = tensor.module.rsplit(".", 1)[-1]
    if leaf not in TARGETABLE:
        raise LoRAAdapterError(
            f"target module {tensor.module!r}: the model has no such LoRA-capable layer "
            f"(supported: {', '.join(TARGETABLE)})"
        )
    layer = _LAYER.search(tensor.module)
    if num_layers is not None and (layer is None or int(layer.group(1)) >= num_layers):
        raise LoRAAdapterError(
            f"target module {tensor.module!r}: the model has no such layer ({num_layers} layers)"
        )
    if len(shape) != 2:
        raise LoRAAdapterError(f"tensor {name!r} has shape {list(shape)}, expected 2 dimensions")
    rank = shape[0] if tensor.which == "lora_A" else shape[1]
    if rank > max_lora_rank:
        raise LoRAAdapterError(
            f"LoRA rank {rank} of {tensor.module!r} is greater than max_lora_rank "
            f"{max_lora_rank} (--max-lora-rank)"
        )
    return AdapterTensor(module=tensor.module, which=tensor.which, shape=shape)
