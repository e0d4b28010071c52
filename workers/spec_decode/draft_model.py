"""The draft-model proposer: a small checkpoint with the target's tokenizer, run beside the
target in each worker (unsharded, even when the target uses tensor parallelism), drafts ``k``
tokens per request autoregressively.

Its paged KV cache has as many blocks as the target's and uses the same block ids: the engine
core allocates ``k`` lookahead slots per request past the verified tokens for the drafts.

Per row it keeps ``draft_computed``, the positions whose draft KV is valid. At ``propose``:

1. ``draft_computed = min(draft_computed, batch.num_computed)``: positions at or past the
   target's computed count may hold drafts that were rejected.
2. One batched varlen forward catches every scheduled row up on its known tokens
   ``[draft_computed, end)``: ``end`` is ``num_tokens`` for rows asked for drafts, and
   ``num_computed`` for the others (a row part-way through its prompt proposes nothing). The
   forward feeds at most ``max_num_batched_tokens`` tokens, rows in batch order: a row left
   behind (a long prompt, whose target KV came from the prefix cache) proposes nothing this
   step and goes on catching up in the next ones.
3. ``k - 1`` batched single-token forwards, each feeding the previous draft.

A new request (``reset_row``) is recomputed from position 0, whatever the target's prefix-cache
hits or KV offload loads were: the draft KV of those blocks may never have been written.
Greedy rows take the argmax; random rows sample ``softmax(logits / temperature)`` (no top-k,
top-p or penalties: rejection sampling keeps the target's distribution for any draft one), with
the request's own generator when seeded. Drafts stop before position ``max_model_len`` and
before any KV position without a block in the row's block table.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from shoal.config.deployment import ShoalConfig
from shoal.kernels.row_argmax import row_argmax
from shoal.workers.config import CheckpointConfig
from shoal.workers.kv_cache import KVCache, bytes_per_block
from shoal.workers.layers.attention import AttentionMetadata
from shoal.workers.layers.weight_packing import pack_linear_weights
from shoal.workers.loader import load_model
from shoal.workers.models.decoder import DecoderForCausalLM
from shoal.workers.parallel import TPContext
from shoal.workers.sampler import exponential_race
from shoal.workers.spec_decode.proposer import Drafts

if TYPE_CHECKING:
    from shoal.workers.input_batch import InputBatch, StepInputs
    from shoal.workers.request_store import CachedRequestState


def draft_bytes_per_block(config: ShoalConfig, dtype: torch.dtype) -> int:
    """K and V bytes of one block of the draft's KV cache (for the worker's memory budget)."""
    cfg = CheckpointConfig.from_dir(_draft_dir(config))
    return bytes_per_block(
        num_layers=cfg.num_layers,
        block_size=config.cache_config.block_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=dtype,
    )


def _draft_dir(config: ShoalConfig) -> Path:
    model = config.speculative_config.speculative_model
    if not model:
        raise ValueError("speculative_config.model (the draft checkpoint) is not set")
    return Path(model)


class DraftModelProposer:
    """Drafts with ``config.speculative_config.speculative_model`` (see the module)."""

    def __init__(
        self,
        config: ShoalConfig,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        vocab_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.dtype = dtype
        # per batch row: positions whose draft KV is valid
        self.draft_computed = np.zeros(config.scheduler_config.max_num_seqs, dtype=np.int64)
        # tokens one catch-up forward may feed (as many as a target step may run)
        self.max_catch_up_tokens = config.scheduler_config.max_num_batched_tokens
        self._model: DecoderForCausalLM | None = None

    def load(self) -> None:
        """Load the draft checkpoint (one rank, unsharded) and allocate its KV cache."""
        path = _draft_dir(self.config)
        cfg = CheckpointConfig.from_dir(path)
        if cfg.vocab_size != self.vocab_size:
            raise ValueError(
                f"draft model {path} has a vocabulary of {cfg.vocab_size} tokens but the "
                f"target's has {self.vocab_size}: the draft must share the target's tokenizer"
            )
        limit = min(cfg.max_position_embeddings, cfg.sliding_window or cfg.max_position_embeddings)
        if limit < self.max_model_len:
            raise ValueError(
                f"draft model {path} serves at most {limit} positions, below "
                f"max_model_len={self.max_model_len}"
            )
        model, cfg = load_model(
            path,
            dtype=self.dtype,
            device=self.device,
            tp=TPContext(rank=0, size=1),
            max_positions=self.max_model_len,
            dequantize=self.config.model_config.dequantize,
        )
        pack_linear_weights(model, self.device, self.dtype)
        layers = model.attention_layers()
        self.kv_cache = KVCache.allocate(
            num_layers=cfg.num_layers,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_kv_heads=layers[0].num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for layer, k, v in zip(layers, self.kv_cache.k, self.kv_cache.v, strict=True):
            layer.bind_cache(k, v)
        self._model = model

    @property
    def model(self) -> DecoderForCausalLM:
        if self._model is None:
            raise RuntimeError("DraftModelProposer.load() has not been called")
        return self._model

    def reset_row(self, row: int) -> None:
        """A request took ``row``: none of the row's draft KV is valid."""
        self.draft_computed[row] = 0

    @torch.inference_mode()
    def propose(
        self, batch: InputBatch, inputs: StepInputs, sampling_rows: np.ndarray, k: int
    ) -> Drafts:
        """Up to ``k`` drafts for each of ``sampling_rows`` (each must be scheduled in
        ``inputs``). ``Drafts.probs`` is ``[B, k, V]`` when some row samples at random; rows of
        greedy requests, and positions past a row's drafts, are zeros there."""
        sampling_rows = np.asarray(sampling_rows, dtype=np.int64)
        drafts = Drafts.empty(len(sampling_rows), k)
        rows = np.asarray(inputs.rows, dtype=np.int64)
        order = {int(row): i for i, row in enumerate(rows)}
        missing = [int(r) for r in sampling_rows if int(r) not in order]
        if missing:
            raise ValueError(f"rows {missing} are asked for drafts but were not scheduled")
        idx = np.fromiter((order[int(r)] for r in sampling_rows), np.int64, len(sampling_rows))
        num_drafts, last = self._catch_up(batch, rows, idx, k)
        drafts.num_drafts = num_drafts
        if not num_drafts.any():
            return drafts
        states = [batch.requests[inputs.req_ids[i]] for i in idx]
        sampler = _DraftSampler(states, k, self.vocab_size, self.device)
        self._draft(batch, sampling_rows, num_drafts, last, sampler)
        drafts.token_ids = sampler.token_ids.cpu().numpy()
        drafts.probs = sampler.probs
        ran = num_drafts > 0
        self.draft_computed[sampling_rows[ran]] = batch.num_tokens[sampling_rows[ran]] + (
            num_drafts[ran] - 1
        )
        return drafts

    def _catch_up(
        self, batch: InputBatch, rows: np.ndarray, idx: np.ndarray, k: int
    ) -> tuple[np.ndarray, torch.Tensor | None]:
        """Feed every scheduled row its known tokens not yet in the draft KV. Returns the number
        of drafts each sampling row gets, and the logits at the last known token of the rows
        that get some ([R, V], in sampling order)."""
        wants = np.zeros(len(rows), dtype=bool)
        if k > 0:
            wants[idx] = True
        num_tokens = batch.num_tokens[rows]
        capacity = batch.num_blocks[rows] * self.block_size  # positions that have a block
        start = np.minimum(self.draft_computed[rows], batch.num_computed[rows])
        end = np.minimum(np.where(wants, num_tokens, batch.num_computed[rows]), capacity)
        start = np.minimum(start, end)
        end = start + _within_budget(end - start, self.max_catch_up_tokens)
        # draft j (1-based) sits at num_tokens - 1 + j; its input's KV at num_tokens - 2 + j
        budget = np.minimum(self.max_model_len - num_tokens, capacity - num_tokens + 1)
        num = np.where(wants & (end == num_tokens) & (end > start), np.minimum(k, budget), 0)
        num = np.maximum(num, 0)
        fed = end > start
        logits = None
        if fed.any():
            hidden = self._forward(batch, rows[fed], start[fed], end[fed])  # [F, hidden]
            at = np.cumsum(fed) - 1  # row index → index among the fed rows
            first = idx[num[idx] > 0]
            if len(first):
                rows_at = torch.from_numpy(at[first]).to(self.device)
                logits = self.model.compute_logits(hidden[rows_at])
        self.draft_computed[rows] = end
        return num[idx], logits

    def _draft(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        num_drafts: np.ndarray,
        logits: torch.Tensor | None,
        sampler: _DraftSampler,
    ) -> None:
        """Draw draft 1 from the catch-up logits, then each next one from a forward of the
        previous draft, for the rows that still want one."""
        active = np.flatnonzero(num_drafts > 0)
        assert logits is not None
        sampler.draw(logits, active, 0)
        for j in range(1, int(num_drafts.max())):
            keep = num_drafts[active] > j
            active = active[keep]
            previous = sampler.token_ids[torch.from_numpy(active).to(self.device), j - 1]
            position = batch.num_tokens[rows[active]] + (j - 1)  # where the previous draft sits
            hidden = self._forward(batch, rows[active], position, position + 1, previous)
            sampler.draw(self.model.compute_logits(hidden), active, j)

    def _forward(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        start: np.ndarray,
        end: np.ndarray,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One varlen forward of positions ``[start, end)`` of each row (tokens from the batch
        unless ``input_ids`` are given); the hidden state of each row's last position."""
        counts = end - start
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        token_rows = np.repeat(rows, counts)
        positions = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1] - start, counts)
        blocks = batch.block_table[token_rows, positions // self.block_size].astype(np.int64)
        max_seq_len = int(end.max())
        max_blocks = -(-max_seq_len // self.block_size)
        if input_ids is None:
            input_ids = self._dev(batch.token_ids[token_rows, positions])
        meta = AttentionMetadata(
            slot_mapping=self._dev(blocks * self.block_size + positions % self.block_size),
            block_tables=self._dev(batch.block_table[rows, :max_blocks]),
            query_start_loc=self._dev(cu.astype(np.int32)),
            seq_lens=self._dev(end.astype(np.int32)),
            max_query_len=int(counts.max()),
            max_seq_len=max_seq_len,
        )
        hidden = self.model(input_ids, self._dev(positions), meta)
        return hidden[self._dev(cu[1:] - 1)]

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)


class _DraftSampler:
    """Draws the drafts of one ``propose`` call and keeps them (and their distributions) on the
    device, indexed by position in ``sampling_rows``."""

    def __init__(
        self, states: list[CachedRequestState], k: int, vocab_size: int, device: torch.device
    ) -> None:
        greedy = [s.sampling_params.is_greedy for s in states]
        self.greedy = np.asarray(greedy, dtype=bool)
        self.temperature = torch.tensor(
            [1.0 if s.sampling_params.is_greedy else s.sampling_params.temperature for s in states],
            dtype=torch.float32,
            device=device,
        )
        self.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        self.token_ids = torch.full((len(states), k), -1, dtype=torch.int64, device=device)
        self.probs: torch.Tensor | None = None
        if not all(greedy):
            self.probs = torch.zeros(len(states), k, vocab_size, device=device)

    def draw(self, logits: torch.Tensor, active: np.ndarray, j: int) -> None:
        """Draft ``j`` of each ``active`` row (indices into sampling order) from ``logits``."""
        device = logits.device
        tokens = row_argmax(logits)
        random = np.flatnonzero(~self.greedy[active])
        if self.probs is not None and len(random):
            who = active[random]
            who_t = torch.from_numpy(who).to(device)
            scaled = logits[torch.from_numpy(random).to(device)] / self.temperature[who_t, None]
            probs = torch.softmax(scaled.float(), dim=-1)  # [r, V]
            self.probs[who_t, j] = probs
            mine = self.generators
            gens = {i: mine[int(w)] for i, w in enumerate(who) if int(w) in mine}
            tokens[torch.from_numpy(random).to(device)] = exponential_race(probs.clone(), gens)
        self.token_ids[torch.from_numpy(active).to(device), j] = tokens


def _within_budget(lengths: np.ndarray, budget: int) -> np.ndarray:
    """``lengths`` cut, in order, so that their sum stays within ``budget``."""
    before = np.cumsum(lengths) - lengths
    return np.clip(budget - before, 0, lengths)
