"""The n-gram ``Proposer``: drafts for the persistent batch's rows from their own known tokens
(``batch.token_ids``), searched by ``propose_ngram_batch`` with the configured
``prompt_lookup_min``/``prompt_lookup_max``, at most ``k`` per request and never past
``max_model_len``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shoal.workers.spec_decode.ngram import propose_ngram_batch
from shoal.workers.spec_decode.proposer import Drafts

if TYPE_CHECKING:
    from shoal.workers.input_batch import InputBatch, StepInputs


class NgramProposer:
    """Prompt-lookup drafts; keeps no per-row state."""

    def __init__(self, *, min_n: int, max_n: int, max_model_len: int) -> None:
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n; got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_model_len = max_model_len

    def reset_row(self, row: int) -> None:
        """Nothing to forget: drafts come from the row's tokens alone."""

    def propose(
        self, batch: InputBatch, inputs: StepInputs, sampling_rows: np.ndarray, k: int
    ) -> Drafts:
        del inputs  # the known tokens are all in the batch
        rows = np.asarray(sampling_rows, dtype=np.int64)
        drafts = Drafts.empty(len(rows), k)
        if len(rows) == 0 or k <= 0:
            return drafts
        lengths = batch.num_tokens[rows]
        width = int(lengths.max())
        found = propose_ngram_batch(
            batch.token_ids[rows, :width], lengths, self.min_n, self.max_n, k, self.max_model_len
        )
        for i, tokens in enumerate(found):
            drafts.token_ids[i, : len(tokens)] = tokens
            drafts.num_drafts[i] = len(tokens)
        return drafts
