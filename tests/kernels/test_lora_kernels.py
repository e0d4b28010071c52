"""Batched multi-LoRA: the slot grouping (``build_mapping``), the torch reference
(``add_lora_torch``) and the Triton kernels (``add_lora_triton``) against a per-token loop in
fp64, and ``add_lora``'s routing to the Triton kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.kernels import lora as lora_kernels
from shoal.kernels import lora_triton
from shoal.kernels.lora import (
    NO_ADAPTER,
    LoRAMapping,
    add_lora,
    add_lora_torch,
    build_mapping,
)
from shoal.kernels.lora_triton import add_lora_triton
from tests.kernels.on_device import device_under_test, on_device

NUM_SLOTS = 4
_N = NO_ADAPTER

# Each token's adapter slot; name -> (slots, whether build_mapping gathers them (order not None))
PATTERNS: dict[str, tuple[list[int], bool]] = {
    "one_slot": ([1] * 9, False),
    "runs": ([0] * 5 + [2] * 3 + [_N] * 2 + [1] * 4, False),
    "some_none": ([_N, _N, 3, 3, _N, _N, _N, 0, 0, _N], False),
    "interleaved": ([0, 2, 0, 1, _N, 2, 2, 0, 1, _N, 1, 3, 0, 3, _N, 2], True),
    # decode-like: one token per sequence, adapters at random (the seed fixes them)
    "scattered": (np.random.default_rng(7).integers(-1, NUM_SLOTS, 24).tolist(), True),
}
ALL_NONE = [_N] * 7


def _case(
    slots: list[int], dim_in: int, dim_out: int, rank: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """y [T, out], x [T, in], a [S, R, in], b [S, out, R], scaled so the deltas are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = len(slots)
    y = torch.randn(tokens, dim_out, generator=gen)
    x = torch.randn(tokens, dim_in, generator=gen)
    a = torch.randn(NUM_SLOTS, rank, dim_in, generator=gen) / dim_in**0.5
    b = torch.randn(NUM_SLOTS, dim_out, rank, generator=gen) / rank**0.5
    return y.to(dtype), x.to(dtype), a.to(dtype), b.to(dtype)


def _naive(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    """``y[t] + b[s] @ (a[s] @ x[t])`` token by token in fp64 (a new tensor)."""
    out = y.double().clone()
    for token, slot in enumerate(slots):
        if slot != NO_ADAPTER:
            out[token] += b[slot].double() @ (a[slot].double() @ x[token].double())
    return out


def _assert_untouched(after: torch.Tensor, before: torch.Tensor, slots: list[int]) -> None:
    """The rows of the tokens with no adapter are bit for bit as they were."""
    rows = [t for t, slot in enumerate(slots) if slot == NO_ADAPTER]
    assert torch.equal(after[rows], before[rows])


# --- build_mapping ---------------------------------------------------------------------------


def _covered(mapping: LoRAMapping) -> list[tuple[int, int]]:
    """(token, slot) for every token the mapping's groups hold, in group order."""
    held = []
    for slot, start, end in mapping.groups:
        rows = range(start, end) if mapping.order is None else mapping.order[start:end].tolist()
        held += [(int(row), slot) for row in rows]
    return held


def test_build_mapping_keeps_adjacent_runs_in_place():
    slots = [1, 1, _N, 0, 0, 0, _N, _N, 2]
    mapping = build_mapping(np.array(slots), "cpu")
    assert mapping is not None
    assert mapping.order is None
    assert mapping.groups == ((1, 0, 2), (0, 3, 6), (2, 8, 9))
    assert mapping.token_slots.dtype == torch.int32
    assert mapping.token_slots.tolist() == slots


def test_build_mapping_gathers_interleaved_slots_by_slot():
    slots = [1, 0, 1, _N, 0, 2]
    mapping = build_mapping(np.array(slots), "cpu")
    assert mapping is not None
    assert mapping.order is not None and mapping.order.dtype == torch.int64
    assert mapping.order.tolist() == [1, 4, 0, 2, 5]  # slot 0's tokens, then 1's, then 2's
    assert mapping.groups == ((0, 0, 2), (1, 2, 4), (2, 4, 5))
    # one slot split by a token with no adapter is gathered too: one group per slot
    split = build_mapping(np.array([3, 3, _N, 3]), "cpu")
    assert split is not None and split.order is not None
    assert split.groups == ((3, 0, 3),) and split.order.tolist() == [0, 1, 3]


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_build_mapping_groups_cover_exactly_the_tokens_with_an_adapter(name):
    slots, gathered = PATTERNS[name]
    mapping = build_mapping(np.array(slots), "cpu")
    assert mapping is not None
    assert (mapping.order is not None) == gathered
    held = _covered(mapping)
    expected = [(t, slot) for t, slot in enumerate(slots) if slot != NO_ADAPTER]
    assert sorted(held) == expected  # every such token once, with its own slot; no others
    if gathered:  # one group per adapter in the batch
        assert [g[0] for g in mapping.groups] == sorted({s for s in slots if s != NO_ADAPTER})
    assert mapping.num_groups == len(mapping.groups)


def test_build_mapping_without_adapters_is_none():
    assert build_mapping(np.array(ALL_NONE), "cpu") is None
    assert build_mapping(np.array([], dtype=np.int32), "cpu") is None


# --- the torch reference ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize(
    ("dim_in", "dim_out", "rank"), [(32, 48, 8), (40, 100, 16), (72, 24, 8), (160, 136, 16)]
)
def test_add_lora_torch_matches_the_per_token_loop(name, dim_in, dim_out, rank):
    slots, gathered = PATTERNS[name]
    y, x, a, b = _case(slots, dim_in, dim_out, rank, torch.float32)
    expected = _naive(y, x, a, b, slots)
    mapping = build_mapping(np.array(slots), "cpu")
    assert mapping is not None and (mapping.order is not None) == gathered
    before = y.clone()
    add_lora_torch(y, x, a, b, mapping)
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)
    _assert_untouched(y, before, slots)


@pytest.mark.parametrize(
    ("slots", "padded"),
    [
        ([0, 1, 2, 3, 0, 1, 2, 3, _N, 2], True),  # decodes spread over adapters: batched
        ([3, 1, _N, 1, 3, 0, 0, 3], True),  # slot 2 unused: padded rows only, dropped
        ([0] * 12 + [1, 2], False),  # one long group: padding would triple the rows
        ([0, 1, 0, 1, 0, 1], False),  # two adapters: a matmul pair each is cheaper
    ],
)
def test_the_batched_form_is_taken_when_it_pays_and_equals_the_loop(slots, padded):
    y, x, a, b = _case(slots, 40, 100, 8, torch.float32)
    expected = _naive(y, x, a, b, slots)
    mapping = build_mapping(np.array(slots), "cpu")
    assert mapping is not None and (mapping.padded is not None) == padded
    before = y.clone()
    add_lora_torch(y, x, a, b, mapping)
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)
    _assert_untouched(y, before, slots)


def test_add_lora_torch_checks_the_reference_with_no_adapter():
    """All tokens without an adapter: no mapping, and the loop leaves y as it is."""
    y, x, a, b = _case(ALL_NONE, 32, 48, 8, torch.float32)
    assert build_mapping(np.array(ALL_NONE), "cpu") is None
    assert torch.equal(_naive(y, x, a, b, ALL_NONE), y.double())


# --- the Triton kernels (interpreter mode on the CPU) ----------------------------------------


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize(
    # R=12: not a power of two; R=40: two rank tiles, the second part masked; in=160: two
    # tiles of `in`; out=100: two tiles of `out`, the second part masked
    ("dim_in", "dim_out", "rank"),
    [(40, 100, 12), (160, 24, 8), (24, 72, 40)],
)
def test_add_lora_triton_matches_the_per_token_loop(name, dim_in, dim_out, rank):
    slots, _ = PATTERNS[name]
    y, x, a, b = _case(slots, dim_in, dim_out, rank, torch.float32)
    expected = _naive(y, x, a, b, slots)
    before = y.clone()
    add_lora_triton(y, x, a, b, torch.tensor(slots, dtype=torch.int32))
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)
    _assert_untouched(y, before, slots)


def test_add_lora_triton_leaves_y_alone_with_no_adapter():
    y, x, a, b = _case(ALL_NONE, 32, 48, 8, torch.float32)
    before = y.clone()
    add_lora_triton(y, x, a, b, torch.tensor(ALL_NONE, dtype=torch.int32))
    assert torch.equal(y, before)


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)], ids=str
)
@pytest.mark.parametrize("name", ["interleaved", "runs"])
def test_add_lora_triton_in_half_precision(dtype, tolerance, name):
    """bf16/fp16 tensors against the fp64 loop on the same rounded values: fp32 sums inside,
    one rounding of each output to y's dtype (bf16: up to one ulp, ~3e-2 at |y| ~ 5, as the
    interpreter truncates fp32 to bf16 where a GPU rounds to nearest)."""
    slots, _ = PATTERNS[name]
    y, x, a, b = _case(slots, 40, 100, 12, dtype)
    expected = _naive(y, x, a, b, slots)
    before = y.clone()
    add_lora_triton(y, x, a, b, torch.tensor(slots, dtype=torch.int32))
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), expected, atol=tolerance, rtol=tolerance)
    _assert_untouched(y, before, slots)


# --- add_lora's dispatch ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["interleaved", "runs"])
def test_add_lora_routes_to_the_triton_kernels(name, monkeypatch):
    slots, _ = PATTERNS[name]
    y, x, a, b = _case(slots, 40, 100, 12, torch.float32)
    mapping = build_mapping(np.array(slots), "cpu")
    assert mapping is not None
    kernel = lora_triton.add_lora_triton
    device = device_under_test()
    if device is not None:  # run it on the GPU too
        kernel = on_device(kernel, device)
    calls: list[torch.Tensor] = []

    def spy(*args: torch.Tensor) -> None:
        calls.append(args[-1])
        kernel(*args)

    monkeypatch.setattr(lora_kernels, "add_lora_triton", spy)
    monkeypatch.setenv("SHOAL_KERNELS", "triton")
    routed = y.clone()
    add_lora(routed, x, a, b, mapping)
    assert len(calls) == 1 and calls[0] is mapping.token_slots
    direct = y.clone()
    add_lora_triton(direct, x, a, b, mapping.token_slots)
    assert torch.equal(routed, direct)
    torch.testing.assert_close(routed.double(), _naive(y, x, a, b, slots), atol=1e-4, rtol=1e-4)

    monkeypatch.setenv("SHOAL_KERNELS", "torch")  # and the torch path does not call it
    add_lora(y, x, a, b, mapping)
    assert len(calls) == 1
    torch.testing.assert_close(y, routed, atol=1e-4, rtol=1e-4)
