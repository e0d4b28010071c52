"""The matmul behind every linear layer: ``F.linear`` on the weight as loaded, oneDNN's on a
copy of the weight packed once into its blocked layout (the CPU), or a weight-only int8/int4
kernel on a weight kept as integer codes (``quant_gemm.QuantizedWeight``).

On the CPU ``F.linear`` in fp32 goes to MKL, which runs slowly on small batches (and on AMD
parts); oneDNN with a pre-packed weight skips the per-call reorder. Measured on a 2-core AMD EPYC
(AVX-512, AVX512-BF16), the linears of a 135M Llama at 2 threads: fp32 2.3x ``F.linear`` at 64
tokens, 3.9x at 16, 2x at one token; bf16 1.2x at 64 tokens, 1.7x at one.

``SHOAL_GEMM=dense|onednn|auto`` (read when a model is packed): ``dense`` keeps ``F.linear``
everywhere; ``onednn`` and ``auto`` pack fp32/bf16 weights on a CPU with oneDNN (``auto`` is the
default). A packed weight is an opaque oneDNN tensor: ``.shape`` and ``.dtype`` as before,
``.to_dense()`` gives the weight back.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from shoal.kernels import quant_gemm
from shoal.kernels.quant_gemm import QuantizedWeight

ENV_VAR = "SHOAL_GEMM"
DENSE, ONEDNN = "dense", "onednn"
_CHOICES = ("auto", DENSE, ONEDNN)
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def gemm_backend(device: torch.device | str, dtype: torch.dtype) -> str:
    """The matmul linear layers of this device and dtype should run (``SHOAL_GEMM`` honoured)."""
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r}: expected one of {', '.join(_CHOICES)}")
    packable = (
        torch.device(device).type == "cpu"
        and dtype in PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
    )
    if choice == ONEDNN and not packable:
        raise RuntimeError(
            f"{ENV_VAR}=onednn needs a CPU build of torch with oneDNN and an fp32/bf16 model"
        )
    return ONEDNN if packable and choice != DENSE else DENSE


def pack_weight(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> opaque oneDNN [out, in]
    """``weight`` reordered into oneDNN's layout for any batch size."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor | QuantizedWeight,  # [out, in]: dense, packed by ``pack_weight``, or codes
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [..., out]
    """``x @ weight.T + bias`` by whichever kernel the weight was prepared for."""
    if isinstance(weight, QuantizedWeight):
        return quant_gemm.linear(x, weight, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
