"""When a step is split into micro-batches, and how data-parallel ranks agree on it, with vLLM's
rules (``ubatch_utils.check_ubatch_thresholds``, ``dp_utils.coordinate_batch_across_dp``, V1
model runner).

Each rank reports its step (``RankBatch``); every rank gathers all reports and calls
``coordinate_batch_across_dp`` on the same list, so all reach the same decisions without another
round trip. A rank votes to split when it allows micro-batching and its own token count reaches
the threshold for its kind (uniform decode or not); the step splits only if every rank votes yes
and, for the smallest rank against the largest padded count, the last micro-batch would still
hold a real token. When it splits, every rank pads to the largest token count; otherwise each
keeps its own. With one rank (DP == 1) a step is never split. shoal's workers do not pad
(``pad_across_ranks=False``): the all-to-all takes any counts, so each rank splits its own
tokens at its own middle, and only a rank's own count can leave its last micro-batch empty.

Not here (no user yet): CUDA-graph padding and mode sync, the dead-rank neutralisation of the
fault-tolerance path, and the V2 runner's variant (threshold on the minimum across ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_DECODE_TOKEN_THRESHOLD = 32
DEFAULT_PREFILL_TOKEN_THRESHOLD = 512


def check_ubatch_thresholds(
    num_tokens: int,
    uniform_decode: bool,
    decode_threshold: int = DEFAULT_DECODE_TOKEN_THRESHOLD,
    prefill_threshold: int = DEFAULT_PREFILL_TOKEN_THRESHOLD,
) -> bool:
    """Whether a batch of ``num_tokens`` is large enough to split: the decode threshold for a
    uniform decode batch (one token per request), the prefill threshold for any other."""
    if uniform_decode:
        return num_tokens >= decode_threshold
    return num_tokens >= prefill_threshold


def is_last_ubatch_empty(orig_tokens: int, padded_tokens: int, num_ubatches: int) -> bool:
    """Whether splitting ``padded_tokens`` evenly leaves the last micro-batch without any of the
    ``orig_tokens`` real tokens (it would hold padding only)."""
    return (padded_tokens // num_ubatches) * (num_ubatches - 1) >= orig_tokens


@dataclass(frozen=True, slots=True)
class RankBatch:
    """One data-parallel rank's report for this step, before any padding across ranks."""

    num_tokens: int  # tokens scheduled on this rank (0 for a rank running a dummy step)
    uniform_decode: bool  # every request runs one decode query: 1 token + its drafts, same for all
    allow_microbatching: bool  # this rank may split (e.g. no prefix reader before its writer)


@dataclass(frozen=True, slots=True)
class BatchDecision:
    """What one rank runs this step: split or not, and its token count after padding."""

    should_ubatch: bool
    num_tokens_padded: int


def check_thresholds_config(
    num_ubatches: int, decode_threshold: int, prefill_threshold: int
) -> None:
    """vLLM's config rule: at least two micro-batches, and thresholds no smaller than their
    count (a batch at the threshold can give every micro-batch a token)."""
    if num_ubatches < 2:
        raise ValueError(f"need at least 2 micro-batches; got {num_ubatches}")
    for name, value in (("decode", decode_threshold), ("prefill", prefill_threshold)):
        if value < num_ubatches:
            raise ValueError(
                f"{name} token threshold {value} is below the micro-batch count {num_ubatches}"
            )


def rank_votes_to_split(report: RankBatch, decode_threshold: int, prefill_threshold: int) -> bool:
    """This rank's own vote: it allows micro-batching and reaches its threshold."""
    return report.allow_microbatching and check_ubatch_thresholds(
        report.num_tokens, report.uniform_decode, decode_threshold, prefill_threshold
    )


def coordinate_batch_across_dp(
    reports: Sequence[RankBatch],
    num_ubatches: int = 2,
    decode_threshold: int = DEFAULT_DECODE_TOKEN_THRESHOLD,
    prefill_threshold: int = DEFAULT_PREFILL_TOKEN_THRESHOLD,
    *,
    pad_across_ranks: bool = True,
) -> list[BatchDecision]:
    """Every rank's decision (index = DP rank) from every rank's report; all ranks compute the
    same list from the same reports. ``pad_across_ranks`` False (shoal's workers: the
    all-to-all takes any counts, so each rank splits its own tokens): every rank keeps its own
    count, and the empty-last-micro-batch veto looks at each rank's own tokens."""
    check_thresholds_config(num_ubatches, decode_threshold, prefill_threshold)
    if not reports:
        raise ValueError("no rank reported")
    if any(r.num_tokens < 0 for r in reports):
        raise ValueError(f"negative token count in {list(reports)}")
    own = [BatchDecision(False, r.num_tokens) for r in reports]
    if len(reports) == 1:
        return own
    votes = [rank_votes_to_split(r, decode_threshold, prefill_threshold) for r in reports]
    if not all(votes):
        return own
    if not pad_across_ranks:
        if any(is_last_ubatch_empty(r.num_tokens, r.num_tokens, num_ubatches) for r in reports):
            return own
        return [BatchDecision(True, r.num_tokens) for r in reports]
    min_orig = min(r.num_tokens for r in reports)
    max_padded = max(r.num_tokens for r in reports)
    if is_last_ubatch_empty(min_orig, max_padded, num_ubatches):
        return own
    return [BatchDecision(True, max_padded) for _ in reports]
