"""Load a Hugging Face checkpoint directory (or a GGUF file's view of one) into a shoal model.

Safetensors files (one, or shards listed in ``model.safetensors.index.json``) are memory-mapped
and read as zero-copy tensor views; each view is copied once, straight into this rank's slice of
its parameter. A progress bar (stderr) shows on checkpoints above ``PROGRESS_MIN_BYTES``.
A GGUF view directory (``workers.gguf``) reads its tensors from the GGUF file instead,
dequantized one at a time, except (on the CPU, unless ``dequantize``) Q4_0/Q4_1/Q8_0 matrices,
handed to the layers as integer codes. Once loaded, linear weights are turned into the codes the
quantized matmuls take (``layers.weight_quantizing``: the checkpoint's, or ``quantization``'s).
Errors name the file or tensor: unsupported architecture, corrupt file, missing or mismatched
tensor, a quantized weight a tensor-parallel split would cut.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from shoal.workers.config import CheckpointConfig, CheckpointConfigError
from shoal.workers.gguf import load_gguf
from shoal.workers.gguf.reader import GGUFFile
from shoal.workers.layers.linear import Loaded
from shoal.workers.layers.weight_quantizing import SCHEMES, quantize_linear_weights
from shoal.workers.models import MOE_ARCHITECTURES, DecoderForCausalLM, model_class_for
from shoal.workers.moe.expert_parallel import EPContext
from shoal.workers.parallel import TPContext

PROGRESS_MIN_BYTES = 512 * 1024 * 1024

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file or tensor and why."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in index order when sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files (only safetensors is read)")
    return files


def read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of one file; tensors are views of a private mmap."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError(f"header length {header_len} exceeds file size {size}")
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors file ({exc})") from exc
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[call-overload,arg-type]
    for name, info in header.items():
        yield name, _tensor_view(path, raw, data_start, name, info)


def _tensor_view(
    path: Path, raw: torch.Tensor, data_start: int, name: str, info: dict
) -> torch.Tensor:
    try:
        dtype = _ST_DTYPES[info["dtype"]]
        shape = [int(d) for d in info["shape"]]
        begin, end = (data_start + int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: bad header entry for {name!r} ({exc})") from exc
    numel = 1
    for d in shape:
        numel *= d
    item = torch.empty(0, dtype=dtype).element_size()
    if end > raw.numel() or end - begin != numel * item:
        raise CheckpointError(
            f"{path}: tensor {name!r} has {end - begin} bytes at [{begin}, {end}) but "
            f"{info['dtype']}{shape} needs {numel * item} (file size {raw.numel()}): corrupt file"
        )
    chunk = raw[begin:end]
    if begin % item:  # misaligned for a typed view: one copy instead
        chunk = chunk.clone()
    return chunk.view(dtype).view(shape)


def iter_checkpoint(
    model_dir: Path, *, progress: bool | None = None, keep_quantized: bool = False
) -> Iterator[tuple[str, Loaded]]:
    """Every tensor of every file, with a byte progress bar when the checkpoint is large;
    ``keep_quantized``: a GGUF file's Q4_0/Q4_1/Q8_0 matrices as ``QuantizedTensor``."""
    if (gguf := load_gguf(model_dir)) is not None:
        yield from _iter_gguf(gguf, progress, keep_quantized)
        return
    files = checkpoint_files(model_dir)
    total = sum(f.stat().st_size for f in files)
    show = progress if progress is not None else total >= PROGRESS_MIN_BYTES
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="loading weights",
        disable=not show,
        file=sys.stderr,
    ) as bar:
        for path in files:
            for name, tensor in read_safetensors(path):
                yield name, tensor
                bar.update(tensor.numel() * tensor.element_size())


def _iter_gguf(
    gguf: GGUFFile, progress: bool | None, keep_quantized: bool
) -> Iterator[tuple[str, Loaded]]:
    show = progress if progress is not None else gguf.nbytes() >= PROGRESS_MIN_BYTES
    tensors = gguf.hf_tensors(keep_quantized=keep_quantized)
    yield from tqdm(tensors, desc="loading GGUF tensors", disable=not show, file=sys.stderr)


def build_model(
    cfg: CheckpointConfig,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    tp: TPContext,
    max_positions: int,
    ep: EPContext | None = None,
) -> DecoderForCausalLM:
    """The empty model for ``cfg``; ``ep`` spreads every sparse MLP's experts (dense: unused)."""
    cls = model_class_for(cfg.architecture)
    if tp.size > 1 and cfg.architecture in MOE_ARCHITECTURES:
        raise CheckpointConfigError(
            f"tensor parallelism is offered for dense models only, not {cfg.architecture}"
        )
    with torch.device(device):
        model = cls(cfg, tp, dtype=dtype, device=device, max_positions=max_positions, ep=ep)
    return model.eval()


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    tp: TPContext | None = None,
    max_positions: int | None = None,
    progress: bool | None = None,
    ep: EPContext | None = None,
    quantization: str | None = None,
    dequantize: bool = False,
) -> tuple[DecoderForCausalLM, CheckpointConfig]:
    """Build the model for ``model_dir``'s architecture and fill every parameter from disk
    (with ``ep``: only this rank's experts). On the CPU a GGUF file's Q4_0/Q4_1/Q8_0 linear
    weights stay quantized unless ``dequantize``; ``quantization`` (``"int8"``/``"int4"``)
    quantizes the other linear weights (``model.linear_weights`` says what became of them)."""
    path = Path(model_dir)
    on_cpu = torch.device(device).type == "cpu"
    if quantization is not None and (quantization not in SCHEMES or not on_cpu):
        raise CheckpointError(
            f"quantization {quantization!r}: expected one of {', '.join(SCHEMES)}, on the CPU"
        )
    cfg = CheckpointConfig.from_dir(path)
    model = build_model(
        cfg,
        dtype=dtype,
        device=device,
        tp=tp or TPContext(),
        max_positions=max_positions or cfg.max_position_embeddings,
        ep=ep,
    )
    tensors = iter_checkpoint(path, progress=progress, keep_quantized=on_cpu and not dequantize)
    try:
        loaded = model.load_weights(tensors)
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc.args[0] if exc.args else exc}") from exc
    _check_complete(model, loaded, path)
    try:
        model.linear_weights = quantize_linear_weights(model, quantization)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    return model, cfg


def _check_complete(model: DecoderForCausalLM, loaded: dict[str, set], path: Path) -> None:
    missing = []
    for name, param in model.named_parameters():
        got = loaded.get(name, set())
        required = param.required_shards  # type: ignore[attr-defined]
        if None in got or required <= got:
            continue
        gaps = sorted(map(repr, required - got))
        missing.append(name if required == {None} else f"{name} (parts {', '.join(gaps[:4])})")
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise CheckpointError(f"{path}: checkpoint is missing tensor(s) for {shown}")
