"""Engine core ↔ worker messages: the step diff and its result.

A worker keeps a persistent batch. ``ExecuteStep`` carries a new request's prompt and blocks
once (``NewRequestData``), then only deltas (``CachedRequestData``). A request preempted and
resumed arrives again as ``NewRequestData`` with ``resumed=True`` and every token it has so far
(prompt plus outputs), to be recomputed from ``num_computed_tokens``. The worker appends the
tokens it samples to its own copy of each request, so decodes need no token ids on the wire.

Async scheduling: the engine core may send step N+1 before step N's result is back. The worker
runs steps one at a time in arrival order (a step arriving while another runs waits its turn)
and has appended the token it sampled in step N before N+1 runs, so a decode scheduled with an
output placeholder reads that token from the worker's own copy; nothing is resolved on the wire.

Speculative decoding: after sampling, the worker proposes up to ``ExecuteStep.num_spec_tokens``
drafts for each request that sampled, keeps them, and reports them (``StepResult.
spec_token_ids``). A later step verifies the first ``CachedRequestData.num_spec_tokens`` of the
worker's latest drafts for that request (padded with -1, always rejected, when it has fewer:
under async scheduling the engine core schedules drafts it has not seen yet); they are counted
in ``num_scheduled_tokens``. The worker's result then carries 1 to ``1 + num_spec_tokens``
tokens for the request (the accepted drafts, then the target's own token). The engine core
rolls back the rejected ones; the worker keeps its own count of computed tokens (which already
excludes them) rather than the engine core's, which under async scheduling may not yet know of
the rejections of a step still in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from shoal.bus.messages.engine import Logprobs
from shoal.bus.messages.fault import FaultInjected, InjectFault
from shoal.bus.messages.kv_handover import KVExportRef, KVPull
from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.offload import KVTransferResult, KVTransfers
from shoal.bus.messages.pooling import PoolingParams
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.structured import GrammarBitmask


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """First appearance of a request on the worker (or reappearance after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    output_token_ids: list[int] = []
    resumed: bool = False
    eos_token_ids: list[int] = []
    lora: LoRARequest | None = None  # the adapter it runs with (multi-LoRA)
    pooling: PoolingParams | None = None  # an embedding: pool the prompt's hidden states


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request already on the worker: blocks to append and tokens to run this step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int  # including the drafts to verify
    num_spec_tokens: int = 0  # of the worker's latest drafts, to verify this step


class BatchOrder(NamedTuple):
    """A step's scheduled requests in batch order, and the tokens each runs (same order)."""

    req_ids: list[str]
    num_scheduled_tokens: list[int]


def batch_order(
    new_requests: Sequence[NewRequestData], cached_requests: Sequence[CachedRequestData]
) -> BatchOrder:
    """The one definition of a step's batch order: new requests, then cached ones.
    ``StepResult`` answers in this order."""
    scheduled: list[NewRequestData | CachedRequestData] = [*new_requests, *cached_requests]
    return BatchOrder([r.req_id for r in scheduled], [r.num_scheduled_tokens for r in scheduled])


class ExecuteStep(msgspec.Struct, tag="step", array_like=True, omit_defaults=True, gc=False):
    """One scheduler step as a diff against the worker's persistent batch.

    Batch order is ``new_requests`` then ``cached_requests`` (``batch_order()``).
    ``finished_req_ids`` and ``preempted_req_ids`` are dropped from the persistent batch before
    the step runs.
    """

    step_id: int
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    finished_req_ids: list[str] = []
    preempted_req_ids: list[str] = []
    kv_transfers: KVTransfers | None = None  # KV offload copies, run before the forward pass
    kv_pulls: list[KVPull] = []  # remote prefills' KV to copy in first (disaggregated prefill)
    num_spec_tokens: int = 0  # drafts to propose after this step per sampling request (K)
    # A round of the engine cores' lock-step group (expert parallelism): every rank's workers
    # run this step's collectives, with no tokens too (``bus/messages/lockstep.py``).
    lockstep: bool = False
    # The tokens each request under a grammar may sample this step (structured outputs), or,
    # with ``grammar_later``, a ``StepGrammar`` for this step comes on the worker's grammar subject.
    grammar: GrammarBitmask | None = None
    grammar_later: bool = False
    # Tracing: the engine core's span of this step for each traced request in it (request id
    # → W3C traceparent); a step joins several requests' traces, so they ride here, not in
    # the message headers.
    trace_parents: dict[str, str] = {}

    def batch_order(self) -> BatchOrder:
        """Scheduled request ids and their token counts, in batch order."""
        return batch_order(self.new_requests, self.cached_requests)


class ResetWorker(msgspec.Struct, tag="reset", array_like=True, omit_defaults=True):
    """Forget every request (after an engine core restart or recovery)."""

    reason: str = ""


class DescribeWorker(msgspec.Struct, tag="describe", array_like=True, omit_defaults=True):
    """Handshake from an engine core: the worker answers with ``WorkerInfo`` once loaded."""

    engine_id: str = ""


class JoinGroup(msgspec.Struct, tag="join_group", array_like=True, omit_defaults=True):
    """(Re)build this engine core's tensor-parallel process group for ``epoch``: drop the old
    group, then join a new one on a fresh port that rank 0 mints and publishes under the epoch's
    key in the deployment's group-ports KV bucket (the other ranks read it). Sent to every rank
    at once at each handshake when fault tolerance is on. Answered with ``GroupJoined``. An
    epoch must be unique for the engine core across its restarts too (a key left by an earlier
    group of the same epoch would send the other ranks to a dead address)."""

    epoch: str
    timeout_s: float = 60.0


class GroupJoined(msgspec.Struct, tag="group_joined", array_like=True, omit_defaults=True):
    """Reply to ``JoinGroup``: this rank is in the group of ``epoch`` at ``init_method``."""

    worker_id: str
    epoch: str
    init_method: str = ""


WorkerInbound = ExecuteStep | ResetWorker | DescribeWorker | JoinGroup | InjectFault


class StepError(msgspec.Struct, array_like=True, omit_defaults=True):
    """Why a step failed, and which requests it failed.

    ``fatal``: the worker's state is suspect (the forward pass raised for the whole batch, or
    the persistent batch could not be updated): with fault tolerance on, the engine core's
    sentinel takes over. Not fatal: only ``req_ids`` are failed (their inputs were at fault:
    ``workers.rejections``, e.g. a token id outside the vocabulary), the step's other requests
    have their tokens in the same result, and the engine core goes on serving.
    """

    message: str
    req_ids: list[str]
    fatal: bool = True


class StepResult(msgspec.Struct, tag="result", array_like=True, omit_defaults=True, gc=False):
    """Sampled tokens per scheduled request, in batch order.

    ``sampled_token_ids[i]`` is empty for a request still part-way through its prompt, and has
    up to ``1 + num_spec_tokens`` tokens for a request that verified drafts (``logprobs[i]``
    then has a row per token). ``logprobs[i]`` / ``prompt_logprobs[i]`` are present only where
    the request asked for them. ``spec_token_ids[i]``: the drafts proposed for the request's
    next step (none padded in; empty list when speculation is off).
    """

    step_id: int
    req_ids: list[str] = []
    sampled_token_ids: list[list[int]] = []
    logprobs: list[Logprobs | None] = []
    prompt_logprobs: list[Logprobs | None] = []
    error: StepError | None = None
    execute_time_s: float = 0.0
    # The worker's idle time before this step: from handing back its previous result to
    # starting this one (includes any time with no work at all; the engine core filters).
    idle_before_s: float = 0.0
    kv_transfer: KVTransferResult | None = None  # what failed of the step's KV copies
    spec_token_ids: list[list[int]] = []
    # pooling requests' embeddings, aligned with req_ids (None: not one, or its prompt is not
    # done); empty when the step has none
    pooled: list[list[float] | None] = []


class WorkerInfo(msgspec.Struct, tag="info", array_like=True, omit_defaults=True):
    """What an engine core needs to know of its worker: KV capacity and model limits.

    ``incarnation`` changes every time the worker process starts, so an engine core can tell
    that its worker was restarted (and lost its persistent batch and KV contents).
    """

    worker_id: str
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    incarnation: str
    tp_rank: int = 0
    tp_size: int = 1
    # The KV cache geometry, for KV offload (``bus.messages.offload.KVLayout``).
    num_layers: int = 0
    num_kv_heads: int = 0  # this rank's
    head_dim: int = 0
    kv_dtype: str = ""
    total_kv_heads: int = 0  # the model's (every rank's together), for a canonical layout
    kv_export: KVExportRef | None = None  # its KV cache, shared for remote decodes to pull


class ResetDone(msgspec.Struct, tag="reset_done", array_like=True, omit_defaults=True):
    """Reply to ``ResetWorker``: the persistent batch is empty."""

    worker_id: str


WorkerOutbound = StepResult | WorkerInfo | ResetDone | GroupJoined | FaultInjected
