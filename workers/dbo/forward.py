"""The model forward over micro-batches: each micro-batch gets its own ``AttentionMetadata`` (the
attention plan is cached on that object by the first layer, so it cannot be shared), the
micro-batches run in the ping-pong executor (``ubatching``), and their hidden states are
concatenated in token order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shoal.workers.dbo.ubatch_slices import UBatchSlice, slice_metadata
from shoal.workers.dbo.ubatching import run_ubatches
from shoal.workers.layers.attention import AttentionMetadata
from shoal.workers.models.decoder import DecoderForCausalLM


def ubatch_metadata(
    meta: AttentionMetadata,
    query_start_loc: np.ndarray,  # [S + 1], the whole step's, on the host
    seq_lens: np.ndarray,  # [S], the whole step's, on the host
    ubatch: UBatchSlice,
) -> AttentionMetadata:
    """One micro-batch's metadata: its tokens' slots, its requests' block-table rows, and the
    lengths of ``slice_metadata`` (a request cut at the split keeps only its tokens here)."""
    sliced = slice_metadata(query_start_loc, seq_lens, ubatch)
    device = meta.query_start_loc.device
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[ubatch.token_slice],
        block_tables=meta.block_tables[ubatch.request_slice],
        query_start_loc=torch.from_numpy(sliced.query_start_loc).to(device),
        seq_lens=torch.from_numpy(sliced.seq_lens).to(device),
        max_query_len=sliced.max_query_len,
        max_seq_len=sliced.max_seq_len,
    )


def check_slices(slices: Sequence[UBatchSlice], num_tokens: int, num_slots: int) -> None:
    """The slices cover ``[0, num_tokens)`` in order, and every token has a slot (padding
    tokens included: their slot is negative)."""
    if not slices:
        raise ValueError("no micro-batch to run")
    starts = [int(s.token_slice.start) for s in slices]
    stops = [int(s.token_slice.stop) for s in slices]
    if starts[0] != 0 or starts[1:] != stops[:-1] or stops[-1] != num_tokens:
        raise ValueError(f"micro-batch token slices {list(zip(starts, stops, strict=True))} "
                         f"do not cover the step's {num_tokens} tokens in order")  # fmt: skip
    if num_slots != num_tokens:
        raise ValueError(f"slot_mapping has {num_slots} entries for {num_tokens} tokens")


@dataclass
class SplitCounts:
    """What ``forward_ubatched`` ran: steps split into micro-batches, and the micro-batches
    (counted from the executor's results, so a step run whole is never counted)."""

    steps: int = 0
    ubatches: int = 0


def forward_ubatched(
    model: DecoderForCausalLM,
    input_ids: torch.Tensor,  # [T] (T includes any padding of the last slice)
    positions: torch.Tensor,  # [T]
    meta: AttentionMetadata,  # the whole step's
    slices: list[UBatchSlice],
    counts: SplitCounts | None = None,
) -> torch.Tensor:  # [T, hidden]
    """``model(input_ids, positions, meta)`` run as one micro-batch per slice in strict
    ping-pong (the MoE all-to-all yields between them); equals the unsplit forward on the
    real tokens. Reads ``query_start_loc``/``seq_lens`` back to the host once. ``counts``
    gains the step and its micro-batches once they ran."""
    check_slices(slices, int(input_ids.shape[0]), int(meta.slot_mapping.shape[0]))
    qsl = meta.query_start_loc.cpu().numpy()
    seq_lens = meta.seq_lens.cpu().numpy()
    metas = [ubatch_metadata(meta, qsl, seq_lens, s) for s in slices]

    def run(s: UBatchSlice, meta_s: AttentionMetadata):  # type: ignore[no-untyped-def]
        return lambda: model(input_ids[s.token_slice], positions[s.token_slice], meta_s)

    hidden = run_ubatches([run(s, m) for s, m in zip(slices, metas, strict=True)])
    if counts is not None:
        counts.steps += 1
        counts.ubatches += len(hidden)
    return torch.cat(hidden)
