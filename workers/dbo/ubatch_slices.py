"""Where a step's tokens are cut into micro-batches, and each micro-batch's attention metadata,
with vLLM's rules (``ubatch_utils.maybe_create_ubatch_slices``, ``_make_metadata_with_slice``).

The cut is on tokens, at ``num_tokens_padded // num_ubatches`` by default: a request may span two
micro-batches. Each ``UBatchSlice`` names the tokens it runs (``token_slice``, into the step's flat
token arrays: input ids, positions, slot mapping) and the requests they belong to
(``request_slice``, into the per-request arrays: rows, block tables); a request cut at a split
sits in both slices. The last slice absorbs the padding.

``slice_metadata`` rebuilds ``query_start_loc``/``seq_lens`` for one slice so that running the
slices one after the other over the same KV cache equals running the whole step: a request cut
at a split keeps, before the cut, its first tokens with ``seq_len`` ending at the cut, and after
it the rest with its full ``seq_len`` (its context then includes the KV the earlier micro-batch
wrote). Positions and slot mappings need no change: ``StepInputs.positions[token_slice]`` already
agree with these lengths.

Padding: tokens past the step's real tokens belong to no request. They sit at the end of the last
slice's ``token_slice``, after ``query_start_loc[-1]`` of its metadata (so
``query_start_loc[-1] < token_slice length``); attention ignores them and the caller gives them
a negative slot (``write_kv`` skips it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.integer]


@dataclass(frozen=True, slots=True)
class UBatchSlice:
    """One micro-batch: its requests (into per-request arrays) and tokens (into flat arrays)."""

    request_slice: slice
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        """Tokens this micro-batch runs, padding included."""
        return int(self.token_slice.stop) - int(self.token_slice.start)

    @property
    def num_reqs(self) -> int:
        return int(self.request_slice.stop) - int(self.request_slice.start)


class UBatchMetadata(NamedTuple):
    """A micro-batch's slice of ``AttentionMetadata``'s host-side fields."""

    query_start_loc: IntArray  # [S_u + 1] int32, from 0; [-1] = real tokens of the micro-batch
    seq_lens: IntArray  # [S_u] int32, context + this micro-batch's queries
    max_query_len: int
    max_seq_len: int


def _split_points(total: int, num_tokens_padded: int, num_ubatches: int, split: int) -> list[int]:
    """Token offsets where each micro-batch ends; the last is the real-token end (padding is
    added by the caller). Each micro-batch must hold at least one real token."""
    points = [split * i for i in range(1, num_ubatches)]
    if split <= 0 or points[-1] >= total:
        raise ValueError(
            f"split point {split} x {num_ubatches} micro-batches leaves one without a real "
            f"token ({total} real tokens, {num_tokens_padded} padded)"
        )
    return [*points, total]


def make_ubatch_slices(
    num_scheduled_tokens: Sequence[int] | IntArray,
    num_tokens_padded: int,
    num_ubatches: int = 2,
    split_point: int | None = None,
) -> list[UBatchSlice]:
    """Cut a batch (tokens per request, batch order) into ``num_ubatches`` micro-batches of
    ``split_point`` tokens each (default ``num_tokens_padded // num_ubatches``), the last one
    taking the rest up to ``num_tokens_padded``.

    A micro-batch holds the requests whose tokens overlap its token range. Raises ValueError
    when a micro-batch would hold no real token (``thresholds.is_last_ubatch_empty`` vetoes
    such a split before it gets here)."""
    scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64)  # [S]
    if num_ubatches < 2:
        raise ValueError(f"need at least 2 micro-batches; got {num_ubatches}")
    if (scheduled < 0).any():
        raise ValueError(f"negative token count in {scheduled.tolist()}")
    cu = np.zeros(len(scheduled) + 1, dtype=np.int64)  # [S + 1]
    np.cumsum(scheduled, out=cu[1:])
    total = int(cu[-1])
    if num_tokens_padded < total:
        raise ValueError(f"num_tokens_padded={num_tokens_padded} < {total} real tokens")
    split = num_tokens_padded // num_ubatches if split_point is None else split_point
    slices = []
    start = 0
    for end in _split_points(total, num_tokens_padded, num_ubatches, split):
        # first request: the one holding token `start` (the later one on a boundary)
        first = int(np.searchsorted(cu, start, side="right")) - 1
        # stop: the first request that starts at or after `end`
        stop = int(np.searchsorted(cu, end, side="left"))
        slices.append(UBatchSlice(slice(first, stop), slice(start, end)))
        start = end
    last = slices[-1]
    slices[-1] = UBatchSlice(last.request_slice, slice(last.token_slice.start, num_tokens_padded))
    return slices


def slice_metadata(
    query_start_loc: np.ndarray,  # [S + 1], the whole step's (StepInputs.query_start_loc)
    seq_lens: np.ndarray,  # [S], the whole step's (StepInputs.seq_lens)
    ubatch: UBatchSlice,
) -> UBatchMetadata:
    """``query_start_loc`` (rebased to 0), ``seq_lens`` and maxima of one micro-batch; a request
    cut at the slice's start loses its earlier tokens from its query, one cut at its end loses
    its later tokens from both its query and its ``seq_len``. The inputs are not modified."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    req, tok = ubatch.request_slice, ubatch.token_slice
    first, last = int(req.start), int(req.stop) - 1
    if last < first:
        raise ValueError(f"micro-batch {ubatch} has no request")
    if not qsl[first] <= tok.start < qsl[first + 1]:
        raise ValueError(f"micro-batch {ubatch} does not start inside its first request")
    new_qsl = qsl[first : last + 2] - qsl[first]  # [S_u + 1], a copy
    new_seq_lens = np.array(seq_lens[first : last + 1], dtype=np.int64)  # [S_u], a copy
    skipped_before = int(tok.start - qsl[first])
    new_qsl[1:] -= skipped_before
    skipped_after = int(qsl[last + 1]) - int(tok.stop)
    if skipped_after > 0:  # cut inside the last request (padding makes this negative)
        new_qsl[-1] -= skipped_after
        new_seq_lens[-1] -= skipped_after
    query_lens = np.diff(new_qsl)
    return UBatchMetadata(
        query_start_loc=new_qsl.astype(np.int32),
        seq_lens=new_seq_lens.astype(np.int32),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(new_seq_lens.max()),
    )
