"""Greedy sampling's argmax on the CPU (``kernels/cpu/row_argmax.c``): torch.argmax's answer on
ties, NaN, infinities and strided rows; what the kernel does not take goes to torch."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import cpu_build, row_argmax
from shoal.kernels.row_argmax import row_argmax as argmax_rows

needs_kernel = pytest.mark.skipif(
    cpu_build.load_kernel_library(row_argmax.LIBRARY) is None,
    reason="no C compiler here: the kernel cannot be built",
)


def _kernel_calls(monkeypatch):  # type: ignore[no-untyped-def]
    """A counter of the rows the C kernel answered (wrapping its library)."""
    served = {"calls": 0}
    real = row_argmax._library_for

    def counting(logits):  # type: ignore[no-untyped-def]
        lib = real(logits)
        served["calls"] += lib is not None
        return lib

    monkeypatch.setattr(row_argmax, "_library_for", counting)
    return served


@needs_kernel
@pytest.mark.parametrize("cols", [1, 15, 16, 17, 1000, 49152])
def test_matches_torch_on_random_rows_with_ties(monkeypatch, cols):
    served = _kernel_calls(monkeypatch)
    gen = torch.Generator().manual_seed(cols)
    logits = torch.randint(-3, 4, (37, cols), generator=gen).float()  # many ties per row
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert served["calls"] == 1


@needs_kernel
def test_nan_infinities_and_strided_rows():
    logits = torch.randn(6, 40)
    logits[0, 7] = float("nan")
    logits[0, 3] = float("inf")  # a NaN wins over inf, as in torch
    logits[1, 9] = logits[1, 30] = float("nan")  # the first NaN
    logits[2] = float("-inf")  # nothing but -inf: index 0
    logits[3, 11] = logits[3, 12] = float("inf")
    logits[4] = 0.0
    expected = [7, 9, 0, 11, 0, int(logits[5].argmax())]
    assert argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist() == expected
    assert argmax_rows(torch.randn(0, 9)).shape == (0,)
    wide = torch.randn(5, 100)
    rows = wide[:, 10:60]  # rows 100 apart
    assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))


def test_what_the_kernel_does_not_take_goes_to_torch(monkeypatch):
    served = _kernel_calls(monkeypatch)
    for logits in (torch.randn(4, 9).bfloat16(), torch.randn(9, 4).T, torch.randn(2, 3, 9)):
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    monkeypatch.setenv("SHOAL_KERNELS", "torch")
    argmax_rows(torch.randn(4, 9))
    assert served["calls"] == 0
