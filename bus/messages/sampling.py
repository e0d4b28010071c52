"""Sampling parameters, with vLLM's names and defaults, validated on construction and on decode.

They are part of the wire schema (the engine client sends them to the engine core, which hands
them to the worker's sampler), so they live here; ``shoal.SamplingParams`` re-exports them.
"""

from __future__ import annotations

import enum
import math

import msgspec

from shoal.bus.messages.structured import StructuredOutputsParams


class OutputKind(enum.IntEnum):
    """How the engine client reports a request's progress."""

    CUMULATIVE = 0  # every output carries all text and tokens so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # a single output, when the request finishes


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample one request's tokens. An invalid value raises ``ValueError`` naming it."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: OutputKind = OutputKind.CUMULATIVE
    # KV offload: the tiers this request may load its prefix from (vLLM's
    # ``kv_transfer_params.kv_load_tiers``): tier types of KV_TIER_TYPES; None: every tier.
    kv_load_tiers: list[str] | None = None
    # vLLM's: token id -> value added to its logit; and the only token ids that may be sampled.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # What the output must match (a JSON schema, a regex, a choice, a grammar): decoding is
    # constrained by a grammar the engine core advances (``engine/core/grammar.py``).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        _check_sampling_params(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def all_stop_strings(self) -> list[str]:
        return list(self.stop or [])


_GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20


def _fail(field: str, message: str) -> None:
    raise ValueError(f"{field} {message}")


KV_TIER_TYPES = ("cpu", "fs", "obj", "p2p")  # the CPU tier, and the secondary tiers' types


def _check_sampling_params(p: SamplingParams) -> None:
    if p.kv_load_tiers is not None:
        unknown = sorted(set(p.kv_load_tiers) - set(KV_TIER_TYPES))
        if unknown:
            _fail("kv_load_tiers", f"names unknown tiers {unknown}; known: {list(KV_TIER_TYPES)}")
    if p.n < 1:
        _fail("n", f"must be at least 1, got {p.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not -2.0 <= value <= 2.0:
            _fail(name, f"must be in [-2, 2], got {value}")
    if p.repetition_penalty <= 0.0:
        _fail("repetition_penalty", f"must be greater than zero, got {p.repetition_penalty}")
    if p.temperature < 0.0:
        _fail("temperature", f"must be non-negative, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        _fail("top_p", f"must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        _fail("top_k", f"must be 0 or -1 (off) or a positive integer, got {p.top_k}")
    if not 0.0 <= p.min_p <= 1.0:
        _fail("min_p", f"must be in [0, 1], got {p.min_p}")
    if p.max_tokens is not None and p.max_tokens < 1:
        _fail("max_tokens", f"must be at least 1, got {p.max_tokens}")
    if p.min_tokens < 0:
        _fail("min_tokens", f"must be non-negative, got {p.min_tokens}")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        _fail("min_tokens", f"must be at most max_tokens={p.max_tokens}, got {p.min_tokens}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            _fail(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
    if p.stop is not None and any(not s for s in p.stop):
        _fail("stop", "must not contain an empty string")
    if p.stop_token_ids is not None and any(t < 0 for t in p.stop_token_ids):
        _fail("stop_token_ids", "must hold non-negative token ids")
    if p.logit_bias is not None:
        if any(t < 0 for t in p.logit_bias):
            _fail("logit_bias", "must have non-negative token ids as keys")
        if not all(math.isfinite(v) for v in p.logit_bias.values()):
            _fail("logit_bias", "values must be finite numbers")
    if p.allowed_token_ids is not None:
        if not p.allowed_token_ids:
            _fail("allowed_token_ids", "must not be empty")
        if any(t < 0 for t in p.allowed_token_ids):
            _fail("allowed_token_ids", "must hold non-negative token ids")


def out_of_vocab(p: SamplingParams, vocab_size: int) -> tuple[str, str] | None:
    """(field, message) when ``logit_bias`` or ``allowed_token_ids`` names a token id at or
    beyond ``vocab_size`` (the sampler could not apply it), else None."""
    for name, ids in (("logit_bias", p.logit_bias), ("allowed_token_ids", p.allowed_token_ids)):
        if ids and max(ids) >= vocab_size:
            high = max(ids)
            return name, f"{name} has token id {high}, out of the vocabulary (size {vocab_size})"
    return None
