"""Verifies one step's draft tokens against the target's probabilities (Leviathan et al.,
arXiv 2211.17192, as vLLM V1's ``RejectionSampler``), batched over requests.

Drafts are flattened: ``target_probs[i]`` is the target's distribution (sampling params already
applied) at draft position ``i``, and request ``b`` owns ``num_draft_tokens[b]`` consecutive
positions. The output is ``[batch, max_k + 1]`` int64, ``PLACEHOLDER_TOKEN_ID`` past each row's
emitted tokens.

* Greedy rows emit ``argmax(target)`` at each position and stop after the first position where
  the draft differs (that position still emits the target's token).
* Random rows accept draft ``d`` when ``p_draft(d) > 0`` and ``p_target(d) / p_draft(d) >= u``
  (``u ~ U[0, 1)``; no draft probs, as for n-gram drafts, means ``p_draft(d) = 1``). The first
  rejection emits a recovered token drawn from ``max(p_target - p_draft, 0)`` (no draft probs:
  ``p_target`` with ``d`` zeroed) by an exponential race ``argmax(prob / q)``, ``q ~ Exp(1)``;
  this keeps the emitted tokens distributed exactly as the target's.
* A row that accepts every draft appends its bonus token (sampled by the regular sampler).
* A draft id ``-1`` (padding, or a draft a grammar ruled out) is always rejected; its recovered
  token is drawn from the plain target distribution.

Seeded rows draw ``u`` then ``q`` from their own generator only, so their tokens do not depend
on the rest of the batch; the others share one draw from the default generator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

PLACEHOLDER_TOKEN_ID = -1


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor | Sequence[bool],
    draft_probs: torch.Tensor | None = None,
    generators: Mapping[int, torch.Generator] | None = None,
) -> torch.Tensor:
    """Emitted tokens per request, ``[batch, max_k + 1]`` int64 padded with -1 (see module)."""
    device = target_probs.device
    batch = len(num_draft_tokens)
    max_k = max(num_draft_tokens, default=0)
    counts = torch.tensor(list(num_draft_tokens), dtype=torch.int64, device=device)
    greedy = torch.as_tensor(is_greedy, dtype=torch.bool, device=device).reshape(batch)
    req_idx = torch.repeat_interleave(torch.arange(batch, device=device), counts)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(req_idx.numel(), device=device) - starts[req_idx]

    draft = draft_token_ids.to(device=device, dtype=torch.int64)
    tokens, accepted = _verify(
        target_probs, draft, draft_probs, greedy, req_idx, num_draft_tokens, generators
    )

    out = torch.full((batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    out[req_idx, pos] = tokens
    out[torch.arange(batch, device=device), counts] = bonus_token_ids.to(device, torch.int64)
    acc = torch.zeros((batch, max_k), dtype=torch.bool, device=device)
    acc[req_idx, pos] = accepted
    num_accepted = torch.cumprod(acc.to(torch.int64), dim=1).sum(dim=1)  # leading accepted run
    cols = torch.arange(max_k + 1, device=device).unsqueeze(0)
    return out.masked_fill(cols > num_accepted.unsqueeze(1), PLACEHOLDER_TOKEN_ID)


def _verify(
    target_probs: torch.Tensor,
    draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    req_idx: torch.Tensor,
    num_draft_tokens: Sequence[int],
    generators: Mapping[int, torch.Generator] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per draft position: the token emitted there if the run reaches it, and whether it is the
    accepted draft."""
    vocab = target_probs.shape[-1]
    valid = (draft >= 0) & (draft < vocab)
    safe = draft.clamp(0, vocab - 1).unsqueeze(1)
    target_argmax = target_probs.argmax(dim=-1)
    greedy_pos = greedy[req_idx]
    accepted = valid & (draft == target_argmax)
    tokens = target_argmax
    if bool(greedy_pos.all()):
        return tokens, accepted

    u, q = _draws(target_probs, greedy, num_draft_tokens, generators)
    p_target = target_probs.gather(1, safe).squeeze(1)
    if draft_probs is None:
        p_draft = torch.ones_like(p_target)
        residual = target_probs.scatter(1, safe, 0.0)
    else:
        p_draft = draft_probs.gather(1, safe).squeeze(1)
        residual = (target_probs - draft_probs).clamp_min(0.0)
    # A rejected -1 draft, or a residual with no mass left, recovers from the target itself.
    use_target = ~valid | (residual.sum(dim=-1) <= 0)
    residual = torch.where(use_target.unsqueeze(1), target_probs, residual)
    recovered = (residual / q).argmax(dim=-1)
    random_accepted = valid & (p_draft > 0) & (p_target >= u * p_draft)
    random_tokens = torch.where(random_accepted, draft, recovered)
    accepted = torch.where(greedy_pos, accepted, random_accepted)
    tokens = torch.where(greedy_pos, tokens, random_tokens)
    return tokens, accepted


def _draws(
    target_probs: torch.Tensor,
    greedy: torch.Tensor,
    num_draft_tokens: Sequence[int],
    generators: Mapping[int, torch.Generator] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``u ~ U[0, 1)`` per draft position and ``q ~ Exp(1)`` per (position, token); a seeded
    random row's slices come from its own generator, ``u`` first."""
    n, vocab = target_probs.shape
    u = torch.rand(n, device=target_probs.device, dtype=target_probs.dtype)
    q = torch.empty_like(target_probs).exponential_()
    if generators:
        start = 0
        greedy_rows = greedy.tolist()
        for row, k in enumerate(num_draft_tokens):
            gen = generators.get(row)
            if gen is not None and k > 0 and not greedy_rows[row]:
                u[start : start + k] = torch.rand(k, device=u.device, dtype=u.dtype, generator=gen)
                q[start : start + k] = torch.empty(
                    (k, vocab), device=q.device, dtype=q.dtype
                ).exponential_(generator=gen)
            start += k
    return u, q


def parse_output(output: torch.Tensor, vocab_size: int | None = None) -> list[list[int]]:
    """The emitted tokens of each row, placeholders (and ids >= ``vocab_size``) dropped."""
    rows: list[list[int]] = output.tolist()
    return [[t for t in row if t >= 0 and (vocab_size is None or t < vocab_size)] for row in rows]
