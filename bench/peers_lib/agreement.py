"""How far the engines' greedy outputs agree: for each pair of engines, how many of the first
prompts got identical token ids, and where each differing pair of outputs first parts. Nothing
fails on a mismatch: fp32 should match; bf16 may drift apart late in a long output."""

from __future__ import annotations

from itertools import combinations
from typing import Any


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a length counts), None if equal."""
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(outputs: dict[str, list[list[int]]]) -> dict[str, dict[str, Any]]:
    """``{"shoal/vllm": {"identical": 7, "of": 8, "first_diff": [None, 93, ...]}, ...}`` for
    every pair of engines that produced outputs."""
    have = {name: outs for name, outs in outputs.items() if outs}
    pairs: dict[str, dict[str, Any]] = {}
    for (a, outs_a), (b, outs_b) in combinations(have.items(), 2):
        diffs = [first_difference(x, y) for x, y in zip(outs_a, outs_b, strict=False)]
        pairs[f"{a}/{b}"] = {
            "identical": sum(d is None for d in diffs),
            "of": len(diffs),
            "first_diff": diffs,
        }
    return pairs


def agreement_line(pairs: dict[str, dict[str, Any]]) -> str:
    """``shoal/vllm 8/8 identical; shoal/hf 7/8 identical (prompt 3 from token 93)``."""
    parts = []
    for pair, facts in pairs.items():
        part = f"{pair} {facts['identical']}/{facts['of']} identical"
        differing = [
            f"prompt {index} from token {position}"
            for index, position in enumerate(facts["first_diff"])
            if position is not None
        ]
        if differing:
            part += f" ({', '.join(differing)})"
        parts.append(part)
    return "; ".join(parts) if parts else "no outputs to compare"
