"""The matmul behind every linear layer: ``F.linear`` on the weight as loaded; on the CPU,
shoal's strip kernel (``strip_gemm.StripWeight``) or oneDNN's on the weight packed once for it;
or a weight-only int8/int4 kernel on a weight kept as integer codes
(``quant_gemm.QuantizedWeight``, or codes in strips: ``strip_gemm.StripCodesWeight``).

On the CPU ``F.linear`` in fp32 goes to MKL, which runs slowly on small batches (and on AMD
parts); oneDNN with a pre-packed weight skips the per-call reorder. Measured on a 2-core AMD EPYC
(AVX-512, AVX512-BF16), the linears of a 135M Llama at 2 threads: fp32 2.3x ``F.linear`` at 64
tokens, 3.9x at 16, 2x at one token; bf16 1.2x at 64 tokens, 1.7x at one.

The strip kernel reads a weight at about twice oneDNN's speed at a few tokens and keeps up
with it at many (``strip_gemm``'s figures); it has paths for fp32 on AVX-512 and bf16 on
AVX512-BF16, bf16 on the matrix units where the CPU has AMX.

``SHOAL_GEMM=auto|strips|onednn|dense`` (read when a model is packed): ``auto`` (the default)
packs fp32/bf16 CPU weights in strips where the kernel has a path for the dtype, else for
oneDNN; ``strips`` and ``onednn`` insist on one; ``dense`` keeps ``F.linear`` everywhere. A
oneDNN weight is an opaque tensor, a strip weight a ``StripWeight``: both keep ``.shape`` and
``.dtype``, and ``.to_dense()`` gives the weight back.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from shoal.kernels import ops, quant_gemm
from shoal.kernels.quant_gemm import QuantizedWeight
from shoal.kernels.strip_gemm import (
    StripCodesWeight,
    StripWeight,
    pack_strips,
    strip_codes_linear,
    strip_gated_linear,
    strip_gemm_available,
    strip_linear,
    strip_packable,
)

ENV_VAR = "SHOAL_GEMM"
DENSE, ONEDNN, STRIPS = "dense", "onednn", "strips"
_CHOICES = ("auto", DENSE, ONEDNN, STRIPS)
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
PreparedWeight = QuantizedWeight | StripWeight | StripCodesWeight  # no plain tensor any more


def gemm_backend(device: torch.device | str, dtype: torch.dtype) -> str:
    """The matmul linear layers of this device and dtype should run (``SHOAL_GEMM`` honoured)."""
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r}: expected one of {', '.join(_CHOICES)}")
    on_cpu = torch.device(device).type == "cpu" and dtype in PACKABLE_DTYPES
    onednn = on_cpu and torch.backends.mkldnn.is_available()
    strips = on_cpu and strip_gemm_available(dtype)
    if choice == ONEDNN and not onednn:
        raise RuntimeError(
            f"{ENV_VAR}=onednn needs a CPU build of torch with oneDNN and an fp32/bf16 model"
        )
    if choice == STRIPS and not strips:
        raise RuntimeError(
            f"{ENV_VAR}=strips needs an fp32 (AVX-512) or bf16 (AVX512-BF16) model on a CPU "
            "the strip kernel was built for, with C kernels allowed"
        )
    if choice in (DENSE, ONEDNN, STRIPS):
        return choice
    return STRIPS if strips else ONEDNN if onednn else DENSE


def pack_weight(weight: torch.Tensor, backend: str) -> torch.Tensor | StripWeight:
    """``weight`` ([out, in]) prepared for ``backend``'s matmul: strips (where the kernel takes
    its shape; else oneDNN's), oneDNN's opaque blocked layout, or itself (dense)."""
    if backend == STRIPS and strip_packable(weight):
        return pack_strips(weight)
    if backend != DENSE and torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    return weight


def gated_linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor | PreparedWeight,  # [2 * inter, in]: a gated MLP's gate rows, then up
    bias: torch.Tensor | None = None,  # [2 * inter]
) -> torch.Tensor:  # [..., inter]
    """``silu(x @ gate.T) * (x @ up.T)`` (biases added): one call where the strip kernel fuses
    the two (bf16 on the matrix units), else ``linear`` then ``ops.silu_and_mul``."""
    if isinstance(weight, StripWeight):
        fused = strip_gated_linear(x, weight, bias)
        if fused is not None:
            return fused
    return ops.silu_and_mul(linear(x, weight, bias))


def linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor | PreparedWeight,  # [out, in]: dense, packed by ``pack_weight``, or codes
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [..., out]
    """``x @ weight.T + bias`` by whichever kernel the weight was prepared for."""
    if isinstance(weight, StripWeight):
        return strip_linear(x, weight, bias)
    if isinstance(weight, StripCodesWeight):
        return strip_codes_linear(x, weight, bias)
    if isinstance(weight, QuantizedWeight):
        return quant_gemm.linear(x, weight, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
