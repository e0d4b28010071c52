"""What a worker of an expert-parallel group adds to each step of its lock-step round
(``ExecuteStep.lockstep``): every rank runs every MoE layer's collectives, so a rank without
tokens runs them on zero tokens (``run_idle``); with DBO the ranks first agree whether to split
the step into two micro-batches (``decide_split``: one all-gather of each rank's
``RankBatch`` over the group, then vLLM's ``coordinate_batch_across_dp`` on every rank alike)
and a split step runs in the two-thread ping-pong (``workers.dbo``).

A rank splits its own tokens at its own middle (no padding across ranks: the all-to-all takes
any counts), so the ranks only have to agree on splitting or not.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from shoal.config.deployment import NUM_UBATCHES, ParallelConfig, ShoalConfig
from shoal.workers.dbo.forward import SplitCounts, forward_ubatched
from shoal.workers.dbo.thresholds import RankBatch, coordinate_batch_across_dp
from shoal.workers.dbo.ubatch_slices import UBatchSlice, make_ubatch_slices
from shoal.workers.input_batch import StepInputs
from shoal.workers.layers.attention import AttentionMetadata
from shoal.workers.layers.moe import FusedExperts
from shoal.workers.models.decoder import DecoderForCausalLM
from shoal.workers.moe.expert_parallel import EPContext
from shoal.workers.parallel import join_default_group


def uniform_decode(inputs: StepInputs) -> bool:
    """Every request runs one decode query of the same length (1 token plus its drafts)."""
    queries = inputs.num_scheduled
    return (
        bool(len(queries))
        and bool((queries == 1 + inputs.num_drafts).all())
        and bool((queries == queries[0]).all())
    )


def may_split(inputs: StepInputs, block_size: int) -> bool:
    """No request reads a KV block that another request of the step writes (a prefix shared
    within the step): split in two, the reader could run before its writer (vLLM's
    ``_allow_microbatching``)."""
    num_reqs = len(inputs.req_ids)
    writer = np.repeat(np.arange(num_reqs), inputs.num_scheduled)  # [T] request of each token
    written = np.unique(np.stack([inputs.slot_mapping // block_size, writer]), axis=1)  # [2, W]
    num_blocks = -(-inputs.seq_lens.astype(np.int64) // block_size)  # [S]
    reads = np.arange(inputs.block_tables.shape[1]) < num_blocks[:, None]  # [S, max_blocks]
    reader = np.nonzero(reads)[0]
    read = inputs.block_tables[reads]
    shared = np.isin(read, written[0])
    writers: dict[int, set[int]] = {}
    for block, req in written.T.tolist():
        writers.setdefault(block, set()).add(req)
    pairs = zip(read[shared].tolist(), reader[shared].tolist(), strict=True)
    return all(writers[block] <= {req} for block, req in pairs)


class ExpertParallelStep:
    def __init__(
        self, ep: EPContext, parallel: ParallelConfig, block_size: int, device: torch.device
    ) -> None:
        self.ep = ep
        self.parallel = parallel
        self.block_size = block_size
        self.device = device
        self.split_counts = SplitCounts()  # steps this rank ran as micro-batches (not: decided to)
        self._joined = False  # this round's collectives have begun on this rank

    @property
    def num_split_steps(self) -> int:
        """Steps this rank ran as micro-batches."""
        return self.split_counts.steps

    @property
    def dbo(self) -> bool:
        return self.parallel.enable_dbo

    def begin_round(self) -> None:
        self._joined = False

    def end_failed_round(self, model: nn.Module) -> None:
        """The step failed on this rank: if it did so before its first collective, run them
        on no tokens (the peers are waiting in them); after, the group is out of step and only
        the collectives' timeout ends the peers' wait."""
        if not self._joined:
            self.run_idle(model)

    def run_idle(self, model: nn.Module) -> None:
        """This rank's part of a round where it has no tokens: the split vote (0 tokens: no),
        then every MoE layer's collectives on zero tokens, in layer order."""
        self._joined = True
        if self.dbo:
            self._gather(RankBatch(0, False, False))
        for experts in (m for m in model.modules() if isinstance(m, FusedExperts)):
            hidden = experts.w13.shape[-1]
            x = torch.empty((0, hidden), dtype=experts.w13.dtype, device=self.device)
            ids = torch.empty((0, 1), dtype=torch.int64, device=self.device)
            experts(x, x.new_empty((0, 1)), ids)

    def decide_split(self, inputs: StepInputs) -> list[UBatchSlice] | None:
        """The micro-batches of this step (None: run whole); every rank must call it."""
        if not self.dbo:
            return None
        report = RankBatch(
            int(inputs.num_scheduled.sum()),
            uniform_decode(inputs),
            may_split(inputs, self.block_size),
        )
        decisions = coordinate_batch_across_dp(
            self._gather(report),
            NUM_UBATCHES,
            self.parallel.dbo_decode_token_threshold,
            self.parallel.dbo_prefill_token_threshold,
            pad_across_ranks=False,
        )
        if not decisions[self.ep.rank].should_ubatch:
            return None
        return make_ubatch_slices(inputs.num_scheduled, report.num_tokens, NUM_UBATCHES)

    def forward(
        self,
        model: DecoderForCausalLM,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        inputs: StepInputs,
    ) -> torch.Tensor:  # [T, hidden]
        slices = self.decide_split(inputs)
        self._joined = True
        if slices is None:
            return model(input_ids, positions, meta)
        return forward_ubatched(model, input_ids, positions, meta, slices, self.split_counts)

    def _gather(self, report: RankBatch) -> list[RankBatch]:
        """Every rank's report, in rank order (one all-gather over the group)."""
        self._joined = True
        mine = torch.tensor(
            [report.num_tokens, report.uniform_decode, report.allow_microbatching],
            dtype=torch.int64,
            device=self.device,
        )
        everyone = [torch.empty_like(mine) for _ in range(self.ep.size)]
        dist.all_gather(everyone, mine, group=self.ep.group)
        return [RankBatch(int(t[0]), bool(t[1]), bool(t[2])) for t in everyone]


def join_expert_parallel(
    config: ShoalConfig, dp_rank: int, init_method: str | None, device: torch.device
) -> ExpertParallelStep | None:
    """Join the expert-parallel group (every data-parallel rank's worker, at ``init_method``)
    when the deployment runs one; None otherwise. With fault tolerance on the group is joined
    later, on ``JoinGroup`` (``workers.parallel.rebuildable_group``): no ``init_method``."""
    parallel = config.parallel_config
    size = parallel.expert_parallel_size
    if size == 1:
        return None
    rebuildable = config.fault_tolerance_config.enable_fault_tolerance
    if not init_method and not rebuildable:
        raise RuntimeError(
            f"expert parallelism over {size} data-parallel ranks needs the group's rendezvous "
            "(ep_init_method, tcp://HOST:PORT)"
        )
    if init_method:
        join_default_group(
            dp_rank, size, init_method, device=str(device), timeout_s=parallel.step_timeout_s
        )
    ep = EPContext(rank=dp_rank, size=size)
    return ExpertParallelStep(ep, parallel, config.cache_config.block_size, device)
