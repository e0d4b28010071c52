"""The worker's persistent batch: every request's tokens, block table and progress, kept in
preallocated arrays between steps and updated from each step's diff.

A request's other state (sampling params, token lists, generator) is its ``CachedRequestState``
in the ``RequestStore`` the batch shares with the sampling metadata builder; its row here is the
one the store gave it. ``add_request``/``remove_request`` are the runner's one way in and out.

``prepare_inputs`` turns one step's schedule into flat model inputs (token ids, positions, slot
mapping, block tables, query_start_loc, seq_lens) with numpy array ops, no per-token Python loop.
Rows are reused as requests come and go.

Speculative decoding: a step's drafts to verify sit in a row right after its known tokens
(``place_drafts``; not counted in ``num_tokens``), so a request may be scheduled past its known
tokens by its drafts and samples when it reaches the end of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.sampling import SamplingParams
from shoal.workers.request_store import CachedRequestState, RequestStore


@dataclass
class StepInputs:
    """Flat inputs of one step; ``S`` scheduled requests, ``T`` tokens (numpy, host side)."""

    req_ids: list[str]
    rows: np.ndarray  # [S] int64
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [S, max_blocks] int32
    query_start_loc: np.ndarray  # [S + 1] int32
    seq_lens: np.ndarray  # [S] int32
    num_computed: np.ndarray  # [S] int64, before this step
    num_scheduled: np.ndarray  # [S] int64
    is_sampling: np.ndarray  # [S] bool: this step reaches the end of the known tokens + drafts
    max_query_len: int
    max_seq_len: int
    num_drafts: np.ndarray  # [S] int64: drafts to verify, the last ones scheduled


class InputBatch:
    """Arrays of ``requests.max_num_reqs`` rows; a row holds one request's whole token history."""

    def __init__(self, requests: RequestStore, *, max_model_len: int, block_size: int) -> None:
        self.requests = requests
        self.max_model_len = max_model_len
        max_num_reqs = requests.max_num_reqs
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        # zero pages are mapped lazily by the OS: only rows in use cost memory
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + outputs known
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        block_ids: list[int],
        num_computed_tokens: int,
        sampling_params: SamplingParams,
        *,
        output_token_ids: Sequence[int] = (),
        eos_token_ids: Sequence[int] = (),
        resumed: bool = False,
        lora: LoRARequest | None = None,
    ) -> CachedRequestState:
        """Add the request to the store and fill its row (prompt, then outputs so far)."""
        num_tokens = len(prompt_token_ids) + len(output_token_ids)
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {req_id}: {num_tokens} tokens exceed max_model_len={self.max_model_len}"
            )
        state = self.requests.add(
            req_id,
            sampling_params,
            prompt_token_ids,
            output_token_ids,
            eos_token_ids,
            resumed=resumed,
            lora=lora,
        )
        row = state.row
        self.token_ids[row, : state.num_prompt_tokens] = state.prompt_token_ids
        self.token_ids[row, state.num_prompt_tokens : num_tokens] = state.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_computed[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        return state

    def remove_request(self, req_id: str, *, preempted: bool = False) -> bool:
        """Drop the request (its row is left as is until reused)."""
        return self.requests.remove(req_id, preempted=preempted) is not None

    def clear(self) -> None:
        self.requests.clear()

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        begin = int(self.num_blocks[row])
        end = begin + len(block_ids)
        if end > self.block_table.shape[1]:
            raise ValueError(f"block table of row {row} overflows ({end} blocks)")
        self.block_table[row, begin:end] = block_ids
        self.num_blocks[row] = end

    def append_token(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each of ``rows`` (vectorised)."""
        positions = self.num_tokens[rows]
        keep = positions < self.max_model_len
        self.token_ids[rows[keep], positions[keep]] = token_ids[keep]
        self.num_tokens[rows[keep]] += 1

    def append_tokens(self, row: int, token_ids: Sequence[int]) -> None:
        """Append a request's emitted tokens (one or more) to its row."""
        begin = int(self.num_tokens[row])
        end = min(begin + len(token_ids), self.max_model_len)
        self.token_ids[row, begin:end] = token_ids[: end - begin]
        self.num_tokens[row] = end

    def place_drafts(self, row: int, draft_token_ids: Sequence[int]) -> None:
        """Write drafts to verify right after the row's known tokens (a -1 pad runs as 0)."""
        begin = int(self.num_tokens[row])
        if begin + len(draft_token_ids) > self.max_model_len:
            raise ValueError(
                f"row {row}: {len(draft_token_ids)} drafts after {begin} tokens exceed "
                f"max_model_len={self.max_model_len}"
            )
        drafts = np.asarray(draft_token_ids, dtype=np.int64)
        self.token_ids[row, begin : begin + len(drafts)] = np.maximum(drafts, 0)

    def prepare_inputs(
        self,
        req_ids: list[str],
        num_scheduled: list[int],
        num_drafts: Sequence[int] | None = None,
    ) -> StepInputs:
        """Flat inputs for ``req_ids``; ``num_drafts`` (same order): drafts placed after each
        request's known tokens, which its scheduled tokens must then reach."""
        rows = np.fromiter((self.requests[r].row for r in req_ids), np.int64, len(req_ids))
        scheduled = np.asarray(num_scheduled, dtype=np.int64)  # [S]
        drafts = np.zeros(len(rows), np.int64) if num_drafts is None else np.asarray(num_drafts)
        computed = self.num_computed[rows]  # [S]
        seq_lens = computed + scheduled
        ends = self.num_tokens[rows] + drafts  # [S] known tokens, then the drafts
        too_long = seq_lens > ends
        if too_long.any():
            bad = [req_ids[i] for i in np.flatnonzero(too_long)]
            raise ValueError(f"requests {bad} scheduled past their known tokens")
        short = (drafts > 0) & (seq_lens < ends)
        if short.any():
            bad = [req_ids[i] for i in np.flatnonzero(short)]
            raise ValueError(f"requests {bad} verify drafts but are not scheduled to their end")
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(scheduled, out=cu[1:])
        total = int(cu[-1])
        token_rows = np.repeat(rows, scheduled)  # [T]
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - computed, scheduled)
        block_index = positions // self.block_size
        if (block_index >= self.num_blocks[token_rows]).any():
            raise ValueError("a scheduled token has no KV block (block table too short)")
        blocks = self.block_table[token_rows, block_index].astype(np.int64)
        max_seq_len = int(seq_lens.max()) if len(rows) else 0
        max_blocks = max(1, -(-max_seq_len // self.block_size))
        return StepInputs(
            req_ids=req_ids,
            rows=rows,
            input_ids=self.token_ids[token_rows, positions],
            positions=positions,
            slot_mapping=blocks * self.block_size + positions % self.block_size,
            block_tables=self.block_table[rows, :max_blocks],
            query_start_loc=cu.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            num_computed=computed,
            num_scheduled=scheduled,
            is_sampling=seq_lens >= ends,
            max_query_len=int(scheduled.max()) if len(rows) else 0,
            max_seq_len=max_seq_len,
            num_drafts=drafts.astype(np.int64, copy=False),
        )

    def advance(self, inputs: StepInputs) -> None:
        """Mark this step's tokens as computed."""
        self.num_computed[inputs.rows] = inputs.num_computed + inputs.num_scheduled
