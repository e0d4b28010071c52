"""Turns one step's logits into sampled tokens and logprobs, batched over requests, as vLLM V1
does it.

Order: raw logprobs (``log_softmax`` of the model's logits, vLLM's default ``raw_logprobs``
mode) → allowed_token_ids mask → min_tokens mask → logit_bias → penalties (repetition over
prompt+output, presence and frequency over output) → greedy argmax; for random rows:
temperature → min-p → top-k → top-p → an exponential race ``argmax(probs / q)``,
``q ~ Exp(1)``, drawn from the row's own generator when seeded (so a seeded request's tokens do
not depend on the rest of the batch) and from the default generator in one call for the others.
Nothing here copies device data to the host, except CPU top-p, which checks on the host whether
every nucleus lies among the 256 most likely tokens (a full sort of the vocabulary is ~5x slower
there) and falls back to the sort otherwise.

``LogprobsTensors.to_wire_rows`` / ``to_wire`` turn the tensors into wire ``Logprobs`` with one
host copy per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal.bus.messages.engine import Logprobs
from shoal.kernels.row_argmax import row_argmax
from shoal.workers.logit_constraints import apply_allowed, apply_bias
from shoal.workers.sampling_metadata import PenaltyTensors, SamplingMetadata

_TOP_P_CANDIDATES = 256  # CPU top-p looks at this many tokens before falling back to a sort


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs of one position per row: column 0 is the actual token, then the top-n."""

    token_ids: torch.Tensor  # [R, n + 1] int64
    logprobs: torch.Tensor  # [R, n + 1] fp32
    ranks: torch.Tensor  # [R] int64: rank of column 0's token (1 = most likely)

    def to_wire_rows(self, num_logprobs: Sequence[int | None]) -> list[Logprobs | None]:
        """One single-position ``Logprobs`` per row, cut to the row's own top-n (None: none)."""
        token_ids, logprobs, ranks = self._host_lists()
        rows: list[Logprobs | None] = []
        for i, n in enumerate(num_logprobs):
            if n is None:
                rows.append(None)
                continue
            rows.append(
                Logprobs(
                    token_ids=[token_ids[i][: n + 1]],
                    logprobs=[logprobs[i][: n + 1]],
                    ranks=[ranks[i]],
                )
            )
        return rows

    def to_wire(self, num_logprobs: int | None = None) -> Logprobs:
        """All rows as consecutive positions of one request (prompt logprobs)."""
        token_ids, logprobs, ranks = self._host_lists()
        if num_logprobs is not None:
            token_ids = [row[: num_logprobs + 1] for row in token_ids]
            logprobs = [row[: num_logprobs + 1] for row in logprobs]
        return Logprobs(token_ids=token_ids, logprobs=logprobs, ranks=ranks)

    def _host_lists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [R] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    """``Sampler()(logits, metadata)``; ``logits`` ([R, V] fp32) are modified in place."""

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != metadata.num_reqs:
            raise ValueError(
                f"logits must be [num_reqs={metadata.num_reqs}, vocab], got {tuple(logits.shape)}"
            )
        logits = logits.float()  # [R, V]; a no-op on fp32 input
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = compute_logprobs(logits)  # [R, V]
        if metadata.allowed is not None:
            apply_allowed(logits, metadata.allowed)
        if metadata.min_tokens_blocked is not None:
            rows, token_ids = metadata.min_tokens_blocked
            logits[rows, token_ids] = float("-inf")
        if metadata.logit_bias is not None:
            apply_bias(logits, metadata.logit_bias)
        if metadata.penalties is not None:
            apply_penalties(logits, metadata.penalties)
        sampled = sample(logits, metadata)  # [R]
        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """The top ``num_logprobs`` of each row of ``logprobs`` [R, V] plus ``token_ids`` [R]'s own
    logprob and rank (the number of tokens at least as likely as it)."""
    top_logprobs, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)  # [R, n]
    token_ids = token_ids.long().unsqueeze(-1)  # [R, 1]
    token_logprobs = logprobs.gather(-1, token_ids)  # [R, 1]
    ranks = (logprobs >= token_logprobs).sum(dim=-1)  # [R]
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, top_ids], dim=1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=1),
        ranks=ranks,
    )


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprobs of a prompt's next tokens: ``logits`` [P, V] at positions whose following prompt
    tokens are ``next_token_ids`` [P]; the raw model distribution, as for sampled tokens."""
    return gather_logprobs(compute_logprobs(logits), num_logprobs, next_token_ids)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> None:
    """Repetition (tokens in prompt or output: positive logits divided, negative multiplied),
    then frequency (× output count) and presence (× occurs in output) subtracted; in place."""
    rows = penalties.row_indices
    selected = logits if rows is None else logits[rows]  # [P, V]
    output_mask = penalties.output_counts > 0  # [P, V]
    if penalties.uses_repetition:
        repetition = penalties.repetition.unsqueeze(1)  # [P, 1]
        factor = torch.where(selected > 0, 1.0 / repetition, repetition)  # [P, V]
        factor.masked_fill_(~(penalties.prompt_mask | output_mask), 1.0)
        selected = selected * factor
    if penalties.uses_frequency:
        selected = selected - penalties.frequency.unsqueeze(1) * penalties.output_counts
    if penalties.uses_presence:
        selected = selected - penalties.presence.unsqueeze(1) * output_mask
    if rows is None:
        logits.copy_(selected)
    else:
        logits[rows] = selected


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """[R] int64 token ids from processed logits [R, V] (modified in place)."""
    greedy = None if metadata.all_random else row_argmax(logits)
    if metadata.all_greedy:
        assert greedy is not None
        return greedy
    logits.div_(metadata.temperature.unsqueeze(1))
    if metadata.min_p is not None:
        apply_min_p(logits, metadata.min_p)
    apply_top_k_top_p(logits, metadata.top_k, metadata.max_top_k, metadata.top_p)
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    random = exponential_race(probs, metadata.generators)
    if greedy is None:
        return random
    return torch.where(metadata.is_greedy, greedy, random)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below ``min_p`` [R] × the row's top probability."""
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [R, 1]
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor | None,
) -> None:
    """Keep each row's ``top_k`` [R] best logits (ties at the edge kept; ``k == V`` is off),
    then the smallest set whose probability reaches ``top_p`` [R] (always at least one)."""
    if top_k is not None:
        _apply_top_k_only(logits, top_k, max_top_k)
    if top_p is None:
        return
    if logits.device.type == "cpu" and _apply_top_p_among_candidates(logits, top_p):
        return
    _apply_top_p_sorted(logits, top_p)


def _apply_top_p_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Top-p over a full ascending sort: drop tokens whose cumulative probability, counted from
    the least likely, stays within ``1 - top_p``. No host sync."""
    ascending, order = logits.sort(dim=-1)  # [R, V]
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    ascending.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, ascending)


def _apply_top_p_among_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> bool:
    """Top-p over the ``_TOP_P_CANDIDATES`` most likely tokens only, when every row's nucleus
    lies among them (checked on the host: free on the CPU, where a full sort is slow). Keeps a
    token while the probability of the tokens before it is below ``top_p``. False: not applied."""
    num_candidates = min(_TOP_P_CANDIDATES, logits.shape[1])
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    best, best_ids = probs.topk(num_candidates, dim=-1)  # [R, C], most likely first
    cumulative = best.cumsum(dim=-1)  # [R, C]
    is_on = top_p < 1.0  # [R]
    if not bool((~is_on | (cumulative[:, -1] >= top_p)).all()):
        return False
    keep = (cumulative - best) < top_p.unsqueeze(1)  # [R, C]
    drop = torch.ones_like(logits, dtype=torch.bool)  # [R, V]
    drop.scatter_(1, best_ids, ~keep)
    drop &= is_on.unsqueeze(1)
    logits.masked_fill_(drop, float("-inf"))
    return True


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Top-k without a full sort: ``topk(max_top_k)`` and each row's k-th value as its edge."""
    vocab_size = logits.shape[1]
    off = top_k >= vocab_size  # [R]
    k = top_k.masked_fill(off, 1)
    best = logits.topk(min(max_top_k, vocab_size), dim=-1).values  # [R, max_k]
    edge = best.gather(1, (k - 1).unsqueeze(1))  # [R, 1]
    edge.masked_fill_(off.unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < edge, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``argmax(probs / q)`` with ``q ~ Exp(1)``: a draw from each row's distribution. Seeded
    rows draw ``q`` from their own generator; the others share one call on the default one."""
    q = torch.empty_like(probs)  # [R, V]
    if len(generators) < probs.shape[0]:
        _fill_exponential(q, None)
    for row, generator in generators.items():
        _fill_exponential(q[row], generator)
    return probs.div_(q).argmax(dim=-1)


def _fill_exponential(q: torch.Tensor, generator: torch.Generator | None) -> None:
    """Exp(1) samples in place. On the CPU ``-log(U)``, U ~ [0, 1), is ~4x faster than
    ``exponential_``; U = 0 gives q = inf, a token that cannot win (never q = 0)."""
    if q.device.type == "cpu":
        q.uniform_(generator=generator).log_().neg_()
    else:
        q.exponential_(generator=generator)
