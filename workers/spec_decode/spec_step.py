"""The model runner's speculative decoding (``SpecDecoder``): the drafts a step verifies, their
verification, and the drafts proposed for the next step (protocol: ``bus.messages.worker``).

Per step, in the runner's order:

* ``take_cached`` (while applying the diff): a cached request verifies the first
  ``num_spec_tokens`` of the drafts last proposed for it (padded with -1), placed in its row
  right after its known tokens. Its computed count stays the worker's own: the engine core's may
  be ahead (async scheduling: it does not know yet of the rejections of a step in flight).
* ``verify`` (only when some sampling request has drafts; otherwise the runner's plain
  sampler runs): logits at each sampling request's ``n + 1`` last rows, ``verify_drafts``, rank
  0's emitted tokens broadcast to every rank, then appended to the row and the request's state.
* ``finish``: a request that sampled is computed up to its known tokens but the last (the
  rejected drafts' KV is rolled back: it will be overwritten), its old drafts are dropped, and
  up to ``K`` new ones are proposed and kept on its state (``CachedRequestState.spec_token_ids``
  and ``spec_probs``) for its next step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from shoal.bus.messages.engine import Logprobs
from shoal.bus.messages.structured import GrammarBitmask
from shoal.bus.messages.worker import CachedRequestData
from shoal.workers.grammar_mask import apply_grammar_bitmask
from shoal.workers.input_batch import InputBatch, StepInputs
from shoal.workers.parallel import TPContext
from shoal.workers.request_store import CachedRequestState
from shoal.workers.sampling_metadata import SamplingBatch
from shoal.workers.spec_decode.proposer import Proposer
from shoal.workers.spec_decode.verify import verify_drafts

PAD = -1  # a draft the worker never proposed (always rejected); also pads the TP broadcast


def logits_rows(inputs: StepInputs, sampling_idx: np.ndarray) -> np.ndarray:
    """Rows of the flat hidden states to take logits of: each sampling request's ``n + 1``
    last (``n`` its drafts), consecutive per request, in sampling order."""
    ends = inputs.query_start_loc[1:][sampling_idx].astype(np.int64)
    counts = inputs.num_drafts[sampling_idx] + 1
    firsts = np.cumsum(counts) - counts
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(firsts, counts)
    return np.repeat(ends - counts, counts) + offsets


class SpecDecoder:
    """Speculative decoding over the runner's persistent batch (see module)."""

    def __init__(
        self,
        proposer: Proposer,
        *,
        batch: InputBatch,
        sampling: SamplingBatch,
        tp: TPContext,
    ) -> None:
        self.proposer = proposer
        self.batch = batch
        self.requests = batch.requests
        self.sampling = sampling
        self.tp = tp
        self._verifying: dict[str, list[int]] = {}  # this step's drafts, by request

    def begin_step(self) -> None:
        self._verifying.clear()

    def add_request(self, state: CachedRequestState) -> None:
        """A request (new or resumed) took a row."""
        self.proposer.reset_row(state.row)

    def take_cached(self, state: CachedRequestState, cached: CachedRequestData) -> None:
        """Keep the worker's own computed count; place the drafts this step verifies."""
        own = int(self.batch.num_computed[state.row])
        if own > cached.num_computed_tokens:
            raise ValueError(
                f"request {cached.req_id!r}: the engine core says {cached.num_computed_tokens} "
                f"tokens are computed, fewer than the worker's {own}"
            )
        n = cached.num_spec_tokens
        if n <= 0:
            return
        drafts = state.spec_token_ids[:n]
        drafts = drafts + [PAD] * (n - len(drafts))
        self.batch.place_drafts(state.row, drafts)
        self._verifying[cached.req_id] = drafts

    def num_drafts(self, req_ids: Sequence[str]) -> list[int]:
        """Drafts each of ``req_ids`` verifies this step."""
        return [len(self._verifying.get(r, ())) for r in req_ids]

    def verifies(self, inputs: StepInputs, sampling_idx: np.ndarray) -> bool:
        """Whether a sampling request of the step has drafts to verify."""
        return bool(inputs.num_drafts[sampling_idx].any())

    def verify(
        self,
        inputs: StepInputs,
        sampling_idx: np.ndarray,
        hidden: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        grammar: GrammarBitmask | None = None,
    ) -> tuple[list[list[int]], list[Logprobs | None]]:
        """Emitted tokens and logprobs per scheduled request (``[]``/None where none), after
        appending the tokens to the batch and the requests' outputs. ``grammar``: the masks of
        requests under a grammar (the engine core schedules them no drafts: one row each)."""
        num_reqs = len(inputs.req_ids)
        sampled: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs: list[Logprobs | None] = [None] * num_reqs
        rows = torch.from_numpy(logits_rows(inputs, sampling_idx)).to(hidden.device)
        logits = compute_logits(hidden[rows])  # [sum(n_i + 1), V]
        req_ids = [inputs.req_ids[i] for i in sampling_idx]
        states = [self.requests[r] for r in req_ids]
        drafts = [self._verifying.get(r, []) for r in req_ids]
        if grammar is not None:
            ends = np.cumsum([len(d) + 1 for d in drafts])  # each request's rows end there
            first_rows = (ends - [len(d) + 1 for d in drafts]).tolist()
            apply_grammar_bitmask(logits, dict(zip(req_ids, first_rows, strict=True)), grammar)
        metadata = self.sampling.prepare(req_ids)
        verified = verify_drafts(
            logits, metadata, states, drafts, self._draft_probs(states, drafts)
        )
        width = max(len(d) for d in drafts) + 1
        emitted = self._rank0_tokens(verified.token_ids, width, logits.device)
        for i, state, tokens, lp in zip(
            sampling_idx, states, emitted, verified.logprobs, strict=True
        ):
            self.batch.append_tokens(state.row, tokens)
            state.output_token_ids.extend(tokens)
            sampled[i] = tokens
            logprobs[i] = lp
        return sampled, logprobs

    def finish(self, inputs: StepInputs, sampling_idx: np.ndarray, k: int) -> list[list[int]]:
        """Roll back the rejected drafts, drop the used ones, propose up to ``k`` per sampling
        request; ``StepResult.spec_token_ids`` (``[]`` when nothing was proposed)."""
        self._verifying.clear()
        rows = inputs.rows[sampling_idx]
        self.batch.num_computed[rows] = self.batch.num_tokens[rows] - 1
        states = [self.requests[inputs.req_ids[i]] for i in sampling_idx]
        for state in states:
            state.spec_token_ids = []
            state.spec_probs = None
        if k <= 0 or len(rows) == 0:
            return []
        drafts = self.proposer.propose(self.batch, inputs, rows, k)
        if self.tp.size > 1:  # every rank feeds the same drafts (a draft model samples them)
            ids = torch.from_numpy(drafts.token_ids).to(self.requests.device)
            drafts.token_ids = self.tp.broadcast_tokens(ids).cpu().numpy()
        proposed: list[list[int]] = [[] for _ in inputs.req_ids]
        for j, (i, state) in enumerate(zip(sampling_idx, states, strict=True)):
            n = int(drafts.num_drafts[j])
            state.spec_token_ids = [int(t) for t in drafts.token_ids[j, :n]]
            if drafts.probs is not None:
                state.spec_probs = drafts.probs[j, :n]
            proposed[i] = state.spec_token_ids
        return proposed if any(proposed) else []

    def _draft_probs(
        self, states: list[CachedRequestState], drafts: list[list[int]]
    ) -> list[torch.Tensor | None] | None:
        """Per request ``[n, V]``: its kept draft probs, zero rows for padded drafts."""
        if all(s.spec_probs is None for s in states):
            return None
        out: list[torch.Tensor | None] = []
        for state, ids in zip(states, drafts, strict=True):
            probs = state.spec_probs
            if probs is None:
                out.append(None)
                continue
            kept = probs[: len(ids)]
            pad = kept.new_zeros(len(ids) - kept.shape[0], kept.shape[1])
            out.append(torch.cat([kept, pad]))
        return out

    def _rank0_tokens(
        self, token_ids: list[list[int]], width: int, device: torch.device
    ) -> list[list[int]]:
        """Rank 0's emitted tokens on every rank: a ``[B, width]`` tensor padded with -1."""
        padded = torch.full((len(token_ids), width), PAD, dtype=torch.int64)
        for i, tokens in enumerate(token_ids):
            padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        rows = self.tp.broadcast_tokens(padded.to(device)).tolist()
        return [[t for t in row if t != PAD] for row in rows]
