"""One GGUF file: its metadata as Python values, its family and Hugging Face config, and its
tensors under Hugging Face names, dequantized to torch or (Q4_0, Q4_1, Q8_0 matrices, when the
loader asks) as integer codes and scales (``quantized_blocks``).

Parsing a file with the ``gguf`` library's reader takes seconds on a real model (its tokenizer
arrays are read string by string), so a file is parsed once, when its view is made, into a
``GGUFIndex``: the metadata's scalars and each tensor's type, shape and byte offset. The workers
load from the index: the file memory-mapped once, each tensor's bytes dequantized
(``gguf.quants.dequantize``) as the loader asks, so a load holds one dequantized tensor beside the
model at a time.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shoal.workers.gguf.architectures import Family, family_of, hf_config
from shoal.workers.gguf.errors import GGUFError
from shoal.workers.gguf.quantized_blocks import KEPT_TYPES, read_blocks
from shoal.workers.gguf.tensor_names import hf_names, permuted_heads, unpermute_rows
from shoal.workers.layers.quantized_tensor import QuantizedTensor

# The tensor types shoal dequantizes; any other is refused by name.
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
# Array-valued keys too large to be worth keeping (the tokenizer conversion reads the file).
_LARGE_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
)
# general.file_type (llama.cpp's LLAMA_FTYPE) of a file whose weights are all 16-bit floats.
_TORCH_DTYPE_OF_FILE_TYPE = {1: "float16", 32: "bfloat16"}
_FLOAT_ITEMS = {"F32": np.float32, "F16": np.float16}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie in the file, and how to read them."""

    name: str
    type: str  # a GGMLQuantizationType name
    shape: tuple[int, ...]  # numpy order (ggml's ne reversed)
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class GGUFIndex:
    """A parsed GGUF file: its metadata (scalars and small arrays) and its tensors."""

    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    @classmethod
    def parse(cls, path: Path) -> GGUFIndex:
        """The ``gguf`` library's reading of the file (seconds for a real model)."""
        import gguf

        try:
            reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError, IndexError, KeyError) as exc:
            raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from exc
        tensors = {
            t.name: TensorInfo(
                name=t.name,
                type=t.tensor_type.name,
                shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                offset=int(t.data_offset),
                nbytes=int(t.n_bytes),
            )
            for t in reader.tensors
        }
        return cls(_metadata(reader), tensors)

    def to_json(self) -> str:
        tensors = [asdict(t) for t in self.tensors.values()]
        return json.dumps({"metadata": self.metadata, "tensors": tensors})

    @classmethod
    def from_json(cls, text: str) -> GGUFIndex:
        raw = json.loads(text)
        tensors = {
            t["name"]: TensorInfo(**{**t, "shape": tuple(t["shape"])}) for t in raw["tensors"]
        }
        return cls(raw["metadata"], tensors)


class GGUFFile:
    """A GGUF file's family, config and tensors, from its index."""

    def __init__(self, path: Path, index: GGUFIndex | None = None) -> None:
        self.path = path
        self.index = index or GGUFIndex.parse(path)
        self.metadata = self.index.metadata
        self._tensors = self.index.tensors
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{path}: metadata general.architecture is missing")
        self.arch = arch
        try:
            self.family: Family = family_of(arch, self.metadata)
        except GGUFError as exc:
            raise GGUFError(f"{path}: {exc}") from None
        self._check_types()

    def _check_types(self) -> None:
        unsupported = sorted(
            {
                f"{t.type} ({t.name})"
                for t in self._tensors.values()
                if t.type not in SUPPORTED_TYPES
            }
        )
        if unsupported:
            raise GGUFError(
                f"{self.path}: tensor type(s) {', '.join(unsupported[:4])} not supported "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )

    @property
    def num_experts(self) -> int:
        return int(self.metadata.get(f"{self.arch}.expert_count") or 0)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    def hf_config(self) -> dict[str, Any]:
        """config.json for this file."""
        try:
            return hf_config(self.arch, self.family, self.metadata, self._tensor_facts())
        except (GGUFError, KeyError, TypeError, ValueError) as exc:
            raise GGUFError(f"{self.path}: {exc}") from None

    def _tensor_facts(self) -> dict[str, Any]:
        embedding = self._tensors.get("token_embd.weight")
        if embedding is None:
            raise GGUFError("tensor token_embd.weight is missing")
        freqs = self._tensors.get("rope_freqs.weight")
        layers = int(self.metadata.get(f"{self.arch}.block_count") or 0)
        return {
            "vocab_size": embedding.shape[0],
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "dense_layers": [  # an MoE model's layers with a plain MLP
                i
                for i in range(layers)
                if self.num_experts and f"blk.{i}.ffn_gate_inp.weight" not in self._tensors
            ],
            "rope_freq_factors": None if freqs is None else self._read(freqs, None).tolist(),
            "torch_dtype": _TORCH_DTYPE_OF_FILE_TYPE.get(
                int(self.metadata.get("general.file_type", 0)), "float32"
            ),
        }

    def hf_tensors(
        self, *, keep_quantized: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """(Hugging Face name, tensor) for every parameter tensor, q/k rows in Hugging Face's
        order, stacked experts split. Dequantized, except with ``keep_quantized``: a matrix
        stored as Q4_0, Q4_1 or Q8_0 (not a stacked expert tensor) comes as its codes and
        scales (``QuantizedTensor``)."""
        heads = int(self.metadata.get(f"{self.arch}.attention.head_count") or 0)
        kv_heads = self.metadata.get(f"{self.arch}.attention.head_count_kv", heads)
        kv_heads = int(kv_heads[0] if isinstance(kv_heads, list) else kv_heads)
        mapped = _map(self.path)
        for name, info in self._tensors.items():
            names = hf_names(name, self.family, self.num_experts)
            if names is None:
                continue
            if len(names) > 1:  # stacked experts: one slice each
                yield from zip(names, self._read(info, mapped).unbind(0), strict=True)
                continue
            tensor: torch.Tensor | QuantizedTensor
            if keep_quantized and info.type in KEPT_TYPES and len(info.shape) == 2:
                tensor = self._read_codes(info, mapped)
            else:
                tensor = self._read(info, mapped)
            permuted_over = permuted_heads(names[0], heads, kv_heads)
            if self.family.permuted_qk and permuted_over:
                tensor = _unpermute(tensor, permuted_over)
            yield names[0], tensor

    def _read_codes(self, info: TensorInfo, mapped: np.ndarray) -> QuantizedTensor:
        data = mapped[info.offset : info.offset + info.nbytes]
        try:
            return read_blocks(data, info.type, (info.shape[0], info.shape[1]))
        except ValueError as exc:
            raise GGUFError(f"{self.path}: tensor {info.name!r}: {exc}") from exc

    def _read(self, info: TensorInfo, mapped: np.ndarray | None) -> torch.Tensor:
        import gguf
        from gguf.quants import dequantize

        data = (mapped if mapped is not None else _map(self.path))[
            info.offset : info.offset + info.nbytes
        ]
        try:
            if info.type in _FLOAT_ITEMS:
                array = data.view(_FLOAT_ITEMS[info.type]).reshape(info.shape)
            else:
                kind = gguf.GGMLQuantizationType[info.type]
                raw = data.reshape(gguf.quant_shape_to_byte_shape(info.shape, kind))
                array = dequantize(raw, kind)
        except (ValueError, NotImplementedError) as exc:
            raise GGUFError(f"{self.path}: tensor {info.name!r}: {exc}") from exc
        with warnings.catch_warnings():  # a read-only memmap: torch copies before writing
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.ascontiguousarray(array))


def _unpermute(
    tensor: torch.Tensor | QuantizedTensor, num_heads: int
) -> torch.Tensor | QuantizedTensor:
    """The q/k rows back in Hugging Face's order (a quantized tensor's rows carry their codes,
    scales and minimums along)."""
    if isinstance(tensor, QuantizedTensor):
        return tensor.map_rows(lambda rows: unpermute_rows(rows, num_heads))
    return unpermute_rows(tensor, num_heads)


def _map(path: Path) -> np.ndarray:
    """The file's bytes, memory-mapped, as a plain array (a ``np.memmap``'s slicing costs
    seconds over a model's tensors)."""
    return np.asarray(np.memmap(path, mode="r"))


def _metadata(reader: Any) -> dict[str, Any]:
    """Every key's value (strings, numbers, bools, lists), the tokenizer's big arrays left out."""
    values: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in _LARGE_ARRAYS or key.startswith("GGUF."):
            continue
        try:
            value = field.contents()
        except (ValueError, IndexError, TypeError):
            continue
        values[key] = value.item() if isinstance(value, np.generic) else value
    return values
