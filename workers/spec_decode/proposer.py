"""What every draft proposer offers the model runner (``Proposer``), and what it returns
(``Drafts``).

After a step's tokens are verified and appended to the persistent batch, the runner asks the
proposer for up to ``k`` drafts for each request that sampled (``sampling_rows``); the runner
keeps them for the request's next step. The batch then holds, for every row: its known tokens
(``batch.token_ids[row, :batch.num_tokens[row]]``, the latest sampled ones included) and the
tokens whose target KV is computed (``batch.num_computed[row]``: every known token but the last
for a row that sampled).

A proposer with its own model (``draft_model``) keeps per-row state: ``reset_row`` is called
whenever a request takes a row, and it must trust none of its own KV at or past
``batch.num_computed[row]`` (positions past it were fed drafts that may have been rejected).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from shoal.workers.input_batch import InputBatch, StepInputs


@dataclass
class Drafts:
    """Drafts for ``B`` requests, in the order of the ``sampling_rows`` asked for."""

    token_ids: np.ndarray  # [B, k] int64, -1 past each request's drafts
    num_drafts: np.ndarray  # [B] int64, 0..k
    # [B, k, V] fp32: the distribution each draft was drawn from (draft_model, random rows);
    # None: drafts are certain (n-gram, or a greedy draft model: p_draft(d) = 1).
    probs: torch.Tensor | None = None

    @classmethod
    def empty(cls, num_requests: int, k: int) -> Drafts:
        return cls(np.full((num_requests, k), -1, dtype=np.int64), np.zeros(num_requests, np.int64))


class Proposer(Protocol):
    """Drafts tokens for the requests of the persistent batch."""

    def reset_row(self, row: int) -> None:
        """A request (new, or re-added after preemption) took ``row``."""

    def propose(
        self, batch: InputBatch, inputs: StepInputs, sampling_rows: np.ndarray, k: int
    ) -> Drafts:
        """Up to ``k`` drafts for each of ``sampling_rows`` (batch rows, in sampling order).
        ``inputs`` are the step's inputs (every scheduled row, ``inputs.rows``), after the
        step's tokens were appended to ``batch``."""
        ...
