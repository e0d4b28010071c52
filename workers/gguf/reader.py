"""One GGUF file opened with the ``gguf`` library: its metadata as Python values, its family and
Hugging Face config, and its tensors dequantized to torch under Hugging Face names.

Dequantization (``gguf.quants.dequantize``) happens one tensor at a time as the loader asks, so
a load holds one dequantized tensor beside the model at a time; float tensors (F32/F16/BF16) are
read as they are.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shoal.workers.gguf.architectures import Family, family_of, hf_config
from shoal.workers.gguf.errors import GGUFError
from shoal.workers.gguf.tensor_names import hf_names, permuted_heads, unpermute_rows

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
# Array-valued keys too large to be worth reading for the config (the tokenizer reads them).
_LARGE_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
)
# general.file_type (llama.cpp's LLAMA_FTYPE) of a file whose weights are all 16-bit floats.
_TORCH_DTYPE_OF_FILE_TYPE = {1: "float16", 32: "bfloat16"}


class GGUFFile:
    """A GGUF file's metadata, family and tensors (memory-mapped by the reader)."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        try:
            self._reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError, IndexError, KeyError) as exc:
            raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from exc
        self.metadata = _metadata(self._reader)
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{path}: metadata general.architecture is missing")
        self.arch = arch
        try:
            self.family: Family = family_of(arch, self.metadata)
        except GGUFError as exc:
            raise GGUFError(f"{path}: {exc}") from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_types()

    def _check_types(self) -> None:
        unsupported = sorted(
            {
                f"{t.tensor_type.name} ({name})"
                for name, t in self._tensors.items()
                if t.tensor_type.name not in SUPPORTED_TYPES
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
        return {
            "vocab_size": int(embedding.shape[-1]),  # ggml's order: [hidden, vocab]
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "dense_layers": [  # an MoE model's layers with a plain MLP
                i
                for i in range(int(self.metadata.get(f"{self.arch}.block_count") or 0))
                if self.num_experts and f"blk.{i}.ffn_gate_inp.weight" not in self._tensors
            ],
            "rope_freq_factors": None if freqs is None else self._read(freqs).tolist(),
            "torch_dtype": _TORCH_DTYPE_OF_FILE_TYPE.get(
                int(self.metadata.get("general.file_type", 0)), "float32"
            ),
        }

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) for every parameter tensor, dequantized, q/k rows in
        Hugging Face's order, stacked experts split."""
        heads = int(self.metadata.get(f"{self.arch}.attention.head_count") or 0)
        kv_heads = self.metadata.get(f"{self.arch}.attention.head_count_kv", heads)
        kv_heads = int(kv_heads[0] if isinstance(kv_heads, list) else kv_heads)
        for name, info in self._tensors.items():
            names = hf_names(name, self.family, self.num_experts)
            if names is None:
                continue
            tensor = self._read(info)
            if len(names) > 1:  # stacked experts: one slice each
                yield from zip(names, tensor.unbind(0), strict=True)
                continue
            permuted_over = permuted_heads(names[0], heads, kv_heads)
            if self.family.permuted_qk and permuted_over:
                tensor = unpermute_rows(tensor, permuted_over)
            yield names[0], tensor

    def nbytes(self) -> int:
        return sum(int(t.n_bytes) for t in self._tensors.values())

    def _read(self, info: Any) -> torch.Tensor:
        from gguf.quants import dequantize

        try:
            if info.tensor_type.name in ("F32", "F16"):
                array = np.asarray(info.data).reshape([int(d) for d in reversed(info.shape)])
            else:
                array = dequantize(info.data, info.tensor_type)
        except (ValueError, NotImplementedError) as exc:
            raise GGUFError(f"{self.path}: tensor {info.name!r}: {exc}") from exc
        with warnings.catch_warnings():  # a read-only memmap: torch copies before writing
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.ascontiguousarray(array))


def _metadata(reader: Any) -> dict[str, Any]:
    """Every key's value (strings, numbers, bools, lists), the tokenizer's big arrays left out."""
    values: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in _LARGE_ARRAYS or key.startswith("GGUF."):
            continue
        try:
            values[key] = field.contents()
        except (ValueError, IndexError, TypeError):
            continue
    return values
