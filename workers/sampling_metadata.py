"""Per-step batched sampling inputs (``SamplingMetadata``), built by ``SamplingBatch`` from the
worker's per-request state (``RequestStore``, shared with the persistent batch).

Each step the model runner calls ``prepare(req_ids)`` with the requests that sample this step,
in row order. When the rows are the same as the previous step's and no request came or went
since, the cached tensors are reused and only the output token counts (for penalties) are bumped
with the newly appended tokens: no full rebuild, and no device-to-host copy at all.

Rows must be exactly the requests that sample a token this step (not ones part-way through a
prompt chunk): a seeded request's generator advances only when its row is sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shoal.workers.logit_constraints import AllowedTokens, LogitBias, build_allowed, build_bias
from shoal.workers.request_store import CachedRequestState, RequestStore

_SAMPLING_EPS = 1e-5


@dataclass(slots=True)
class PenaltyTensors:
    """Inputs of presence/frequency/repetition penalties for the rows that use any of them."""

    row_indices: torch.Tensor | None  # [P] int64 rows of the batch; None: every row, in order
    prompt_mask: torch.Tensor  # [P, V] bool: the token occurs in the prompt
    output_counts: torch.Tensor  # [P, V] fp32: occurrences of the token in the output so far
    presence: torch.Tensor  # [P] fp32
    frequency: torch.Tensor  # [P] fp32
    repetition: torch.Tensor  # [P] fp32
    # Which penalty kinds some row uses (host side, so unused ones cost nothing).
    uses_presence: bool = True
    uses_frequency: bool = True
    uses_repetition: bool = True


@dataclass(slots=True)
class SamplingMetadata:
    """Everything the sampler needs for one step, batched over ``num_reqs`` rows."""

    num_reqs: int
    temperature: torch.Tensor  # [R] fp32; 1.0 on greedy rows so dividing never hits zero
    is_greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [R] int64; vocab_size where off; None when no row uses it
    max_top_k: int  # the largest top_k in use (host side, avoids a sync)
    top_p: torch.Tensor | None  # [R] fp32; None when no row uses it
    min_p: torch.Tensor | None  # [R] fp32; None when no row uses it
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row → seeded gen
    penalties: PenaltyTensors | None = None
    # Positions masked to -inf until min_tokens outputs exist: (rows [M], token ids [M]).
    min_tokens_blocked: tuple[torch.Tensor, torch.Tensor] | None = None
    # vLLM's allowed_token_ids and logit_bias, for the rows that use them (None: no row does).
    allowed: AllowedTokens | None = None
    logit_bias: LogitBias | None = None
    num_logprobs: list[int | None] = field(default_factory=list)  # per row, as requested
    max_num_logprobs: int | None = None  # None: no row wants logprobs


@dataclass(slots=True)
class _CachedStep:
    req_ids: tuple[str, ...]
    version: int  # of the request store when built
    metadata: SamplingMetadata
    num_outputs: list[int]  # output length of each row when the counts were last updated


class SamplingBatch:
    """Builds ``SamplingMetadata`` per step from the requests in ``requests``."""

    def __init__(self, requests: RequestStore) -> None:
        self.requests = requests
        self.vocab_size = requests.vocab_size
        self.device = requests.device
        self._cached: _CachedStep | None = None

    def prepare(self, req_ids: Sequence[str]) -> SamplingMetadata:
        """The metadata for rows ``req_ids``, reusing the previous step's when rows are equal."""
        key = tuple(req_ids)
        requests = self.requests
        states = [requests[r] for r in key]
        cached = self._cached
        if cached is not None and cached.req_ids == key and cached.version == requests.version:
            self._update_cached(cached, states)
            return cached.metadata
        metadata = self._build(states)
        num_outputs = [len(s.output_token_ids) for s in states]
        self._cached = _CachedStep(key, requests.version, metadata, num_outputs)
        return metadata

    def _build(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        greedy = [p.is_greedy for p in params]
        top_ks = [p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size for p in params]
        uses_top_k = any(k < self.vocab_size for k in top_ks)
        num_logprobs = [p.logprobs for p in params]
        wanted = [n for n in num_logprobs if n is not None]
        return SamplingMetadata(
            num_reqs=len(states),
            temperature=self._tensor(
                [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)],
                torch.float32,
            ),
            is_greedy=self._tensor(greedy, torch.bool),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=self._tensor(top_ks, torch.int64) if uses_top_k else None,
            max_top_k=max((k for k in top_ks if k < self.vocab_size), default=0),
            top_p=self._optional([p.top_p for p in params], off=1.0),
            min_p=self._optional([p.min_p for p in params], off=0.0),
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            penalties=self._build_penalties(states),
            min_tokens_blocked=self._min_tokens_blocked(states),
            allowed=build_allowed(params, self.vocab_size, self._move),
            logit_bias=build_bias(params, self.vocab_size, self._move),
            num_logprobs=num_logprobs,
            max_num_logprobs=max(wanted) if wanted else None,
        )

    def _build_penalties(self, states: list[CachedRequestState]) -> PenaltyTensors | None:
        rows = [i for i, s in enumerate(states) if s.has_penalties]
        if not rows:
            return None
        chosen = [states[i] for i in rows]
        params = [s.sampling_params for s in chosen]
        prompt_mask = torch.zeros(len(rows), self.vocab_size + 1, dtype=torch.bool)
        prompt_mask.scatter_(1, self._padded([s.prompt_token_ids for s in chosen]), True)
        counts = torch.zeros(len(rows), self.vocab_size + 1, dtype=torch.float32)
        outputs = self._padded([s.output_token_ids for s in chosen])
        counts.scatter_add_(1, outputs, torch.ones(outputs.shape, dtype=torch.float32))
        return PenaltyTensors(
            row_indices=None if len(rows) == len(states) else self._tensor(rows, torch.int64),
            prompt_mask=self._move(prompt_mask[:, : self.vocab_size]),
            output_counts=self._move(counts[:, : self.vocab_size]),
            presence=self._tensor([p.presence_penalty for p in params], torch.float32),
            frequency=self._tensor([p.frequency_penalty for p in params], torch.float32),
            repetition=self._tensor([p.repetition_penalty for p in params], torch.float32),
            uses_presence=any(p.presence_penalty != 0.0 for p in params),
            uses_frequency=any(p.frequency_penalty != 0.0 for p in params),
            uses_repetition=any(p.repetition_penalty != 1.0 for p in params),
        )

    def _min_tokens_blocked(
        self, states: list[CachedRequestState]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows: list[int] = []
        tokens: list[int] = []
        for i, s in enumerate(states):
            if len(s.output_token_ids) < s.sampling_params.min_tokens:
                rows += [i] * len(s.stop_token_ids)
                tokens += s.stop_token_ids
        if not rows:
            return None
        return self._tensor(rows, torch.int64), self._tensor(tokens, torch.int64)

    def _update_cached(self, cached: _CachedStep, states: list[CachedRequestState]) -> None:
        metadata = cached.metadata
        if metadata.penalties is not None:
            self._bump_output_counts(metadata.penalties, cached.num_outputs, states)
        cached.num_outputs = [len(s.output_token_ids) for s in states]
        metadata.min_tokens_blocked = self._min_tokens_blocked(states)

    def _bump_output_counts(
        self, penalties: PenaltyTensors, num_outputs: list[int], states: list[CachedRequestState]
    ) -> None:
        """Add the tokens appended since the last step to the cached counts (rows unchanged)."""
        rows = [i for i, s in enumerate(states) if s.has_penalties]
        bump_slots: list[int] = []
        bump_tokens: list[int] = []
        for slot, row in enumerate(rows):
            new_tokens = states[row].output_token_ids[num_outputs[row] :]
            bump_slots += [slot] * len(new_tokens)
            bump_tokens += new_tokens
        if bump_slots:
            index = (self._tensor(bump_slots, torch.int64), self._tensor(bump_tokens, torch.int64))
            ones = torch.ones(len(bump_slots), dtype=torch.float32, device=self.device)
            penalties.output_counts.index_put_(index, ones, accumulate=True)

    def _optional(self, values: list[float], off: float) -> torch.Tensor | None:
        if all(v == off for v in values):
            return None
        return self._tensor(values, torch.float32)

    def _padded(self, rows: list[list[int]]) -> torch.Tensor:
        """[len(rows), max_len] int64 CPU, padded with ``vocab_size`` (a column dropped later)."""
        width = max((len(r) for r in rows), default=0)
        padded = [r + [self.vocab_size] * (width - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.int64).reshape(len(rows), width)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return self._move(torch.tensor(values, dtype=dtype))

    def _move(self, cpu_tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return cpu_tensor
        return cpu_tensor.to(self.device, non_blocking=True)
