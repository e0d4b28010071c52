"""After loading: linear weights turned into integer codes for the weight-only quantized
matmuls (``kernels.quant_gemm``; in bf16 8-bit codes, and 4-bit ones when asked, to
``kernels.strip_gemm``'s where the CPU has AVX512-BF16), before the float ones are packed
(``weight_packing``).

Which weights, and how:

* Rows the checkpoint stored quantized (GGUF Q4_0/Q4_1/Q8_0, handed over as
  ``QuantizedTensor``): a weight whose rows all came so, in one scheme, keeps the file's own
  codes and scales (groups of 32; Q8_0 as int8, Q4_0/Q4_1 as int4). A weight whose rows came
  partly as floats, or in two schemes, is dequantized.
* ``scheme`` (``"int8"``/``"int4"``, ``--quantization``): every other linear weight is quantized
  from its floats in groups of 32 (``layers.quantize``: Q8_0's and Q4_1's schemes).
* The LM head: its own checkpoint weight as any linear; a head tied to the embedding gets a
  quantized copy of the embedding's quantized rows (the embedding itself stays in floats, for
  its lookups), else, with ``scheme``, of the embedding's floats (``HEAD_SCHEMES``).

``quantize_linear_weights`` returns what became of the weights, for the worker's log:
``"Q4_1 as int4 (group 32): 120, Q8_0 as int8 (group 32): 1"``.
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from torch import nn

from shoal.kernels.quant_gemm import QuantizedWeight, compute_dtype, pack_int4, pack_int8
from shoal.kernels.strip_gemm import (
    StripCodesWeight,
    code_strips_available,
    pack_int4_strips,
    pack_int8_strips,
)
from shoal.workers.layers.embedding import Embedding, LMHead
from shoal.workers.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    replace_weight,
)
from shoal.workers.layers.quantize import GROUP_SIZE, quantize_int4, quantize_int8
from shoal.workers.layers.quantized_parts import QuantizedParts
from shoal.workers.layers.quantized_tensor import QuantizedTensor

SCHEMES = ("int8", "int4")
INT4_KERNEL_ENV = "SHOAL_INT4_KERNEL"  # read when codes are packed
INT4_KERNELS = ("torch", "strips", "q8")
LINEAR_LAYERS = (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)
# The LM head under ``--quantization``: int8 either way (int4 logits cost more accuracy than the
# head's share of the bytes buys; see bench/quantized.py).
HEAD_SCHEMES = {"int8": "int8", "int4": "int8"}


def quantize_linear_weights(model: nn.Module, scheme: str | None) -> str:
    """Quantize ``model``'s linear weights in place (see the module); returns a summary."""
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"quantization {scheme!r}: expected one of {', '.join(SCHEMES)}")
    kinds: Counter[str] = Counter()
    for name, module in model.named_modules():
        try:
            if isinstance(module, LINEAR_LAYERS):
                kinds[_quantize_linear(module, scheme)] += 1
            elif isinstance(module, LMHead):
                kinds[_quantize_head(module, scheme)] += 1
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    for module in model.modules():
        if isinstance(module, Embedding):
            _parts(module.weight).clear()
    return ", ".join(f"{kind}: {count}" for kind, count in kinds.most_common())


def _quantize_linear(
    module: ReplicatedLinear | ColumnParallelLinear | RowParallelLinear | LMHead,
    scheme: str | None,
) -> str:
    param = module.weight
    if not isinstance(param, torch.Tensor):
        raise ValueError("its weight is quantized or packed already")
    codes = _checkpoint_codes(param)
    if codes is None and scheme is not None:
        codes = _from_floats(param.data, scheme)
    if codes is None:
        return dtype_name(param.dtype)
    replace_weight(module, _packed(codes))
    return describe(codes)


def _quantize_head(module: LMHead, scheme: str | None) -> str:
    if module.tied_to is None:
        return _quantize_linear(module, scheme and HEAD_SCHEMES[scheme])
    embedding = module.tied_to.weight
    codes = _parts(embedding).joined()
    if codes is None and scheme is not None:
        codes = _from_floats(embedding.data, HEAD_SCHEMES[scheme])
    if codes is None:
        return dtype_name(embedding.dtype)
    module.use_weight(_packed(codes))
    return describe(codes)


def _checkpoint_codes(param: torch.Tensor) -> QuantizedTensor | None:
    """The weight's rows as the checkpoint's codes when they all came so; else None, any
    quantized rows dequantized into the float parameter."""
    parts = _parts(param)
    codes = parts.joined()
    if codes is None and parts:
        parts.spill_into(param.data)
    parts.clear()
    return codes


def _from_floats(weight: torch.Tensor, scheme: str) -> QuantizedTensor:
    source = dtype_name(weight.dtype)
    if scheme == "int8":
        return quantize_int8(weight, source, GROUP_SIZE)
    return quantize_int4(weight, source, GROUP_SIZE)


def _packed(codes: QuantizedTensor) -> QuantizedWeight | StripCodesWeight:
    """The codes packed for their kernel: in bf16 where this CPU has the strip matmul's path
    (AVX512-BF16), in strips (4-bit ones unless ``SHOAL_INT4_KERNEL=torch`` asks otherwise:
    ``_int4_kernel``); everything else in torch's int4 kernel (8 bits as two halves)."""
    in_strips = compute_dtype() == torch.bfloat16 and code_strips_available(
        codes.group_size, codes.shape[1]
    )
    if codes.bits == 8:
        if in_strips:
            return pack_int8_strips(codes.codes, codes.scales, codes.group_size)
        return pack_int8(codes.codes, codes.scales, codes.group_size)
    if codes.mins is None:
        raise ValueError("4-bit codes without group minimums")
    kernel = _int4_kernel()
    if in_strips and kernel != "torch":
        return pack_int4_strips(
            codes.codes, codes.scales, codes.mins, codes.group_size, round_x=kernel == "q8"
        )
    return pack_int4(codes.codes, codes.scales, codes.mins, codes.group_size)


def _int4_kernel() -> str:
    """Which kernel 4-bit codes meet x in (``INT4_KERNEL_ENV``): the strips in bf16 (the
    default where the CPU has them), torch's, or the strips with x rounded to 8 bits a group
    (q8, as llama.cpp's Q4 dots take it). The strips are the default as a decode step of dense
    layers then runs in one C call (``kernels/cpu_decoder_layers.py``; torch's kernel cannot be
    called from there): one request on the default model 57 -> 72 tokens/s, 32 at once 150 ->
    160; from 8 rows the strips decode onto the CPU's matrix units where it has them (prefill
    ~6x torch's kernel; docs/cpu.md)."""
    choice = os.environ.get(INT4_KERNEL_ENV, "strips").strip().lower() or "strips"
    if choice not in INT4_KERNELS:
        raise ValueError(f"{INT4_KERNEL_ENV}={choice!r}: expected one of {', '.join(INT4_KERNELS)}")
    return choice


def describe(codes: QuantizedTensor) -> str:
    """What the checkpoint stored and what the kernel multiplies by."""
    return f"{codes.source} as int{codes.bits} (group {codes.group_size})"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parts(param: torch.Tensor) -> QuantizedParts:
    return param.quantized_parts  # type: ignore[attr-defined]
