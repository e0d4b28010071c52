"""Verifies one step's draft tokens with the target's logits, applying every sampling option the
plain ``Sampler`` applies (vLLM V1's ``RejectionSampler`` path).

Request ``i`` owns ``n_i + 1`` consecutive logits rows: one per draft, then its bonus row. Row
``j`` is processed as the plain sampler would process a single row whose output so far is
``output_token_ids + drafts[:j]``: the allowed_token_ids mask, min_tokens masking, logit_bias,
penalties (counts include the earlier drafts), then greedy argmax, or temperature → min-p →
top-k → top-p → probabilities. The per request metadata is expanded to rows with tensor ops
(penalty counts by one scatter and a cumsum); requests without penalties, min_tokens, allowed
ids or a bias cost nothing there.

Drafts are accepted by ``rejection_sample`` (greedy: while equal to the argmax); the bonus row is
sampled by the sampler's own ``sample`` (seeded requests from their generator, first), so a
request without drafts gets exactly the plain sampler's token. Logprobs are the raw
``log_softmax`` at each emitted position, as the sampler's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal.bus.messages.engine import Logprobs
from shoal.workers.logit_constraints import apply_allowed, apply_bias, expand_allowed, expand_bias
from shoal.workers.request_store import CachedRequestState
from shoal.workers.sampler import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    compute_logprobs,
    gather_logprobs,
    sample,
)
from shoal.workers.sampling_metadata import PenaltyTensors, SamplingMetadata
from shoal.workers.spec_decode.rejection_sampler import parse_output, rejection_sample


@dataclass(slots=True)
class Verified:
    """One step's outcome per request: emitted tokens (accepted drafts, then the target's own)."""

    token_ids: list[list[int]]
    logprobs: list[Logprobs | None]  # one row per emitted token; None where not asked


@dataclass(slots=True)
class _Layout:
    """Where each request's rows lie in the flattened logits (host side)."""

    num_drafts: list[int]
    starts: list[int]  # first row of each request
    row_req: torch.Tensor  # [T] int64: the request of each row
    draft_rows: torch.Tensor  # [D] int64: rows that verify a draft
    bonus_rows: torch.Tensor  # [R] int64: each request's last row


def verify_drafts(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    states: Sequence[CachedRequestState],
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> Verified:
    """Emitted tokens and logprobs of each request (see module); ``logits`` are modified."""
    with torch.no_grad():
        layout = _layout(metadata, states, draft_token_ids, logits)
        logits = logits.float()
        raw = compute_logprobs(logits) if metadata.max_num_logprobs is not None else None
        _apply_row_constraints(logits, metadata, states, draft_token_ids, layout)
        bonus = sample(logits[layout.bonus_rows], metadata)  # [R]
        drafts = _flat_drafts(draft_token_ids, logits.device)
        target_probs = _target_probs(logits[layout.draft_rows], metadata, layout)
        out = rejection_sample(
            target_probs,
            drafts,
            layout.num_drafts,
            bonus,
            metadata.is_greedy,
            _flat_draft_probs(draft_probs, draft_token_ids, logits),
            metadata.generators,
        )
        token_ids = parse_output(out)
        logprobs = _logprobs(raw, out, metadata, layout, token_ids)
    return Verified(token_ids=token_ids, logprobs=logprobs)


def _layout(
    metadata: SamplingMetadata,
    states: Sequence[CachedRequestState],
    draft_token_ids: Sequence[Sequence[int]],
    logits: torch.Tensor,
) -> _Layout:
    num_reqs = metadata.num_reqs
    if len(states) != num_reqs or len(draft_token_ids) != num_reqs:
        raise ValueError(
            f"{num_reqs} metadata rows, {len(states)} states, {len(draft_token_ids)} draft lists"
        )
    num_drafts = [len(d) for d in draft_token_ids]
    starts, total = [], 0
    for n in num_drafts:
        starts.append(total)
        total += n + 1
    if logits.dim() != 2 or logits.shape[0] != total:
        raise ValueError(f"logits must be [sum(n_i + 1)={total}, vocab], got {logits.shape}")
    device = logits.device
    rows_per_req = torch.tensor([n + 1 for n in num_drafts], dtype=torch.int64)
    row_req = torch.repeat_interleave(torch.arange(num_reqs), rows_per_req)
    bonus = [s + n for s, n in zip(starts, num_drafts, strict=True)]
    is_draft = torch.ones(total, dtype=torch.bool)
    is_draft[bonus] = False
    return _Layout(
        num_drafts=num_drafts,
        starts=starts,
        row_req=row_req.to(device),
        draft_rows=torch.arange(total)[is_draft].to(device),
        bonus_rows=torch.tensor(bonus, dtype=torch.int64, device=device),
    )


def _apply_row_constraints(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    states: Sequence[CachedRequestState],
    draft_token_ids: Sequence[Sequence[int]],
    layout: _Layout,
) -> None:
    """The sampler's constraints on every row, in its order, with the drafts before a row as
    its outputs: allowed ids, min_tokens, logit bias, penalties."""
    num_rows = [n + 1 for n in layout.num_drafts]
    if metadata.allowed is not None or metadata.logit_bias is not None:
        starts = torch.tensor(layout.starts, dtype=torch.int64).to(logits.device)
        counts = torch.tensor(num_rows, dtype=torch.int64).to(logits.device)
    if metadata.allowed is not None:
        apply_allowed(logits, expand_allowed(metadata.allowed, starts, counts, num_rows))
    if metadata.min_tokens_blocked is not None:
        rows, tokens = _min_tokens_blocked(states, layout)
        if rows:
            index = torch.tensor([rows, tokens], dtype=torch.int64).to(logits.device)
            logits[index[0], index[1]] = float("-inf")
    if metadata.logit_bias is not None:
        apply_bias(logits, expand_bias(metadata.logit_bias, starts, counts, num_rows))
    if metadata.penalties is not None:
        apply_penalties(
            logits, _expand_penalties(metadata.penalties, states, draft_token_ids, layout)
        )


def _min_tokens_blocked(
    states: Sequence[CachedRequestState], layout: _Layout
) -> tuple[list[int], list[int]]:
    """(rows, token ids) to mask: a request's stop ids at its positions below min_tokens."""
    rows: list[int] = []
    tokens: list[int] = []
    for i, state in enumerate(states):
        blocked = state.sampling_params.min_tokens - len(state.output_token_ids)
        for j in range(min(blocked, layout.num_drafts[i] + 1)):
            rows += [layout.starts[i] + j] * len(state.stop_token_ids)
            tokens += state.stop_token_ids
    return rows, tokens


def _expand_penalties(
    penalties: PenaltyTensors,
    states: Sequence[CachedRequestState],
    draft_token_ids: Sequence[Sequence[int]],
    layout: _Layout,
) -> PenaltyTensors:
    """The penalty inputs per row: each penalised request's, repeated over its rows, with the
    output counts of row ``j`` bumped by the request's drafts before ``j``."""
    reqs = [i for i, s in enumerate(states) if s.has_penalties]
    device = penalties.output_counts.device
    reps = torch.tensor([layout.num_drafts[i] + 1 for i in reqs], dtype=torch.int64, device=device)
    rows = None
    if len(reqs) < len(states):
        spans = [range(layout.starts[i], layout.starts[i] + layout.num_drafts[i] + 1) for i in reqs]
        rows = torch.tensor([r for span in spans for r in span], dtype=torch.int64).to(device)
    counts = penalties.output_counts.repeat_interleave(reps, dim=0)  # [rows, V]
    counts += _draft_counts([draft_token_ids[i] for i in reqs], counts)
    return PenaltyTensors(
        row_indices=rows,
        prompt_mask=penalties.prompt_mask.repeat_interleave(reps, dim=0),
        output_counts=counts,
        presence=penalties.presence.repeat_interleave(reps),
        frequency=penalties.frequency.repeat_interleave(reps),
        repetition=penalties.repetition.repeat_interleave(reps),
        uses_presence=penalties.uses_presence,
        uses_frequency=penalties.uses_frequency,
        uses_repetition=penalties.uses_repetition,
    )


def _draft_counts(drafts: Sequence[Sequence[int]], like: torch.Tensor) -> torch.Tensor | float:
    """[rows, V]: at a request's row ``j``, how often each token occurs in its ``drafts[:j]``
    (requests of ``len(d) + 1`` consecutive rows). Draft ``k`` adds 1 from the request's row
    ``k + 1`` and -1 from the next request's first row; one cumsum sums them up."""
    vocab = like.shape[1]
    bump_rows: list[int] = []
    bump_tokens: list[int] = []
    bump_values: list[float] = []
    start = 0
    for request_drafts in drafts:
        end = start + len(request_drafts) + 1
        for k, token in enumerate(request_drafts):
            if 0 <= token < vocab:
                bump_rows += [start + k + 1, end]
                bump_tokens += [token, token]
                bump_values += [1.0, -1.0]
        start = end
    if not bump_rows:
        return 0.0
    bumps = torch.zeros(start + 1, vocab, dtype=like.dtype, device=like.device)
    index = torch.tensor([bump_rows, bump_tokens], dtype=torch.int64).to(like.device)
    values = torch.tensor(bump_values, dtype=like.dtype).to(like.device)
    bumps.index_put_((index[0], index[1]), values, accumulate=True)
    return bumps.cumsum(dim=0)[:start]


def _target_probs(
    logits: torch.Tensor, metadata: SamplingMetadata, layout: _Layout
) -> torch.Tensor:
    """[D, V] target distributions at the draft rows: the processed softmax (greedy rows only
    need their argmax, which temperature 1 and the top-k/top-p/min-p masks keep)."""
    if metadata.all_greedy:
        return logits  # rejection_sample reads only the argmax of greedy rows
    req = layout.row_req[layout.draft_rows]  # [D]
    logits.div_(metadata.temperature[req].unsqueeze(1))
    if metadata.min_p is not None:
        apply_min_p(logits, metadata.min_p[req])
    top_k = None if metadata.top_k is None else metadata.top_k[req]
    top_p = None if metadata.top_p is None else metadata.top_p[req]
    apply_top_k_top_p(logits, top_k, metadata.max_top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _flat_drafts(draft_token_ids: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    flat = [t for drafts in draft_token_ids for t in drafts]
    return torch.tensor(flat, dtype=torch.int64, device=device)


def _flat_draft_probs(
    draft_probs: Sequence[torch.Tensor | None] | None,
    draft_token_ids: Sequence[Sequence[int]],
    logits: torch.Tensor,
) -> torch.Tensor | None:
    """[D, V] draft distributions, or None when no request has any. A request without probs in
    a batch that has some gets one-hot rows on its drafts (p_draft = 1, the same verdicts)."""
    if draft_probs is None or all(p is None for p in draft_probs):
        return None
    vocab = logits.shape[1]
    parts = []
    for probs, drafts in zip(draft_probs, draft_token_ids, strict=True):
        if probs is not None:
            parts.append(probs.to(device=logits.device, dtype=torch.float32).reshape(-1, vocab))
            continue
        ids = torch.tensor(list(drafts), dtype=torch.int64).reshape(-1, 1)
        one_hot = torch.zeros(len(drafts), vocab + 1)  # column vocab catches invalid drafts
        one_hot.scatter_(1, torch.where((ids >= 0) & (ids < vocab), ids, vocab), 1.0)
        parts.append(one_hot[:, :vocab].to(logits.device))
    return torch.cat(parts)


def _logprobs(
    raw: torch.Tensor | None,
    out: torch.Tensor,
    metadata: SamplingMetadata,
    layout: _Layout,
    token_ids: list[list[int]],
) -> list[Logprobs | None]:
    """Per request, the raw logprobs of each emitted token plus the top-n, one host copy."""
    if raw is None:
        return [None] * metadata.num_reqs
    assert metadata.max_num_logprobs is not None
    pos = (
        torch.arange(raw.shape[0], device=raw.device)
        - torch.tensor(layout.starts, device=raw.device)[layout.row_req]
    )
    emitted = out[layout.row_req, pos].clamp_min(0)  # [T]; rows past the run are dropped below
    rows = gather_logprobs(raw, metadata.max_num_logprobs, emitted)
    ids, values, ranks = rows.token_ids.tolist(), rows.logprobs.tolist(), rows.ranks.tolist()
    result: list[Logprobs | None] = []
    for i, n in enumerate(metadata.num_logprobs):
        if n is None:
            result.append(None)
            continue
        span = range(layout.starts[i], layout.starts[i] + len(token_ids[i]))
        result.append(
            Logprobs(
                token_ids=[ids[r][: n + 1] for r in span],
                logprobs=[values[r][: n + 1] for r in span],
                ranks=[ranks[r] for r in span],
            )
        )
    return result
