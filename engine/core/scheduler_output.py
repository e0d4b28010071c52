"""What one ``Scheduler.schedule()`` call decided, and its wire form ``ExecuteStep``.

The step is a diff against the worker's persistent batch: a request's prompt and whole block
table appear once (``NewRequestData``; again with ``resumed=True`` and prompt + outputs after a
preemption), then only deltas (``CachedRequestData``: blocks to append, tokens to run). Batch
order (new requests, then cached ones) is defined once, by ``bus.messages.worker.batch_order``;
``StepResult`` answers in the same order.

``StepPlan`` is the scheduler's scratch state while it decides a step; ``build_scheduler_output``
turns it into the ``SchedulerOutput`` and books the step on its requests: ``num_computed_tokens``
advances (optimistically), the step counts as in flight for each, and a request whose tokens reach
its end this step (it samples) gets ``num_placeholders_per_step`` output placeholders (1 with
async scheduling, 0 without) plus one per draft it verifies (with async scheduling), given back
when the result lands. Drafts to verify (speculative decoding, ``spec_decoding.py``) are part of
a request's scheduled tokens; ``num_spec_tokens`` says how many.
"""

from __future__ import annotations

from collections.abc import Callable

from shoal.bus.messages.kv_handover import KVPull
from shoal.bus.messages.offload import KVTransfers
from shoal.bus.messages.structured import GrammarBitmask
from shoal.bus.messages.worker import (
    CachedRequestData,
    ExecuteStep,
    NewRequestData,
    batch_order,
)
from shoal.engine.core.request import Request


class SchedulerOutput:
    """One step: the requests to run, how many tokens each, and what to drop first."""

    __slots__ = (
        "cached_requests",
        "finished_req_ids",
        "grammar",
        "grammar_drafts",
        "grammar_later",
        "kv_pulls",
        "kv_transfers",
        "landed",
        "new_requests",
        "num_placeholders",
        "num_scheduled_tokens",
        "num_spec_tokens",
        "num_spec_tokens_to_propose",
        "preempted_req_ids",
        "requests",
        "sampling_req_ids",
        "skipped_req_ids",
        "step_id",
        "total_num_scheduled_tokens",
    )

    def __init__(
        self,
        step_id: int,
        new_requests: list[NewRequestData],
        cached_requests: list[CachedRequestData],
        num_scheduled_tokens: dict[str, int],
        finished_req_ids: list[str],
        preempted_req_ids: list[str],
    ) -> None:
        self.step_id = step_id
        self.new_requests = new_requests
        self.cached_requests = cached_requests
        self.num_scheduled_tokens = num_scheduled_tokens  # req_id → tokens this step
        self.total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        self.finished_req_ids = finished_req_ids
        self.preempted_req_ids = preempted_req_ids
        self.requests: dict[str, Request] = {}  # req_id → the request scheduled
        self.num_placeholders: dict[str, int] = {}  # req_id → output placeholders it booked
        self.landed = False  # its result arrived (``Scheduler.land_step``)
        self.skipped_req_ids: set[str] = set()  # whose output is stale or for a finished one
        self.kv_transfers: KVTransfers | None = None  # KV offload copies to run first
        self.kv_pulls: list[KVPull] = []  # remote prefills' KV to pull first
        self.num_spec_tokens: dict[str, int] = {}  # req_id → drafts it verifies (when any)
        self.sampling_req_ids: list[str] = []  # requests scheduled to the end of their tokens
        self.num_spec_tokens_to_propose = 0  # K: drafts per sampling request, after the step
        self.grammar: GrammarBitmask | None = None  # masks of the requests under a grammar
        self.grammar_later = False  # the masks go after the step (``StepGrammar``)
        self.grammar_drafts: dict[str, list[int]] = {}  # the drafts those masks cover

    @property
    def req_ids(self) -> list[str]:
        """Scheduled request ids in batch order (the wire schema's ``batch_order``)."""
        return batch_order(self.new_requests, self.cached_requests).req_ids

    @property
    def is_empty(self) -> bool:
        """Nothing to run, nothing for the worker to drop and nothing to copy."""
        return not (
            self.num_scheduled_tokens
            or self.finished_req_ids
            or self.preempted_req_ids
            or self.kv_transfers
        )

    def to_message(self) -> ExecuteStep:
        return ExecuteStep(
            self.step_id,
            self.new_requests,
            self.cached_requests,
            self.finished_req_ids,
            self.preempted_req_ids,
            self.kv_transfers,
            self.kv_pulls,
            self.num_spec_tokens_to_propose,
            grammar=self.grammar,
            grammar_later=self.grammar_later,
        )

    def __repr__(self) -> str:
        return (
            f"SchedulerOutput(step={self.step_id}, new={len(self.new_requests)}, "
            f"cached={len(self.cached_requests)}, tokens={self.total_num_scheduled_tokens}, "
            f"finished={len(self.finished_req_ids)}, preempted={len(self.preempted_req_ids)})"
        )


class StepPlan:
    """What the current ``schedule()`` call has decided so far."""

    __slots__ = (
        "cached",
        "cached_block_ids",
        "new",
        "num_scheduled",
        "num_spec",
        "preempted",
        "token_budget",
    )

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.num_scheduled: dict[str, int] = {}  # drafts to verify included
        self.num_spec: dict[str, int] = {}  # drafts to verify, where any
        self.cached: list[Request] = []  # running requests scheduled, in order
        self.cached_block_ids: list[list[int]] = []  # their newly allocated block ids
        self.new: list[tuple[Request, bool]] = []  # admitted requests, resumed or not
        self.preempted: list[str] = []


def build_scheduler_output(
    step_id: int,
    plan: StepPlan,
    get_block_ids: Callable[[str], list[int]],
    finished_req_ids: list[str],
    preempted_req_ids: list[str],
    num_placeholders_per_step: int = 0,
) -> SchedulerOutput:
    """The step's diff; books it on each scheduled request (see the module docstring)."""
    num_scheduled = plan.num_scheduled
    new_requests = []
    for request, resumed in plan.new:
        request_id = request.request_id
        num_tokens = num_scheduled[request_id]
        new_requests.append(
            NewRequestData(
                request_id,
                request.prompt_token_ids,
                request.sampling_params,
                get_block_ids(request_id),
                request.num_computed_tokens,
                num_tokens,
                list(request.output_token_ids) if resumed else [],
                resumed,
                request.eos_token_ids,
                request.lora_request,
                request.pooling_params,
            )
        )
    cached_requests = []
    num_spec = plan.num_spec
    for request, new_block_ids in zip(plan.cached, plan.cached_block_ids, strict=True):
        request_id = request.request_id
        cached_requests.append(
            CachedRequestData(
                request_id,
                new_block_ids,
                request.num_computed_tokens,
                num_scheduled[request_id],
                num_spec.get(request_id, 0),
            )
        )
    output = SchedulerOutput(
        step_id, new_requests, cached_requests, num_scheduled, finished_req_ids, preempted_req_ids
    )
    output.num_spec_tokens = num_spec
    _book(output, [request for request, _ in plan.new] + plan.cached, num_placeholders_per_step)
    return output


def _book(output: SchedulerOutput, requests: list[Request], num_placeholders_per_step: int) -> None:
    """Advance the scheduled requests' counts; note (and, with placeholders, book) the ones that
    sample."""
    scheduled, num_placeholders = output.requests, output.num_placeholders
    num_scheduled, num_spec = output.num_scheduled_tokens, output.num_spec_tokens
    sampling = output.sampling_req_ids
    for request in requests:
        request_id = request.request_id
        scheduled[request_id] = request
        num_tokens = num_scheduled[request_id]
        request.num_computed_tokens += num_tokens
        request.num_in_flight_steps += 1
        request.num_in_flight_tokens += num_tokens
        if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
            sampling.append(request_id)
            if num_placeholders_per_step:
                booked = num_placeholders_per_step + num_spec.get(request_id, 0)
                request.num_output_placeholders += booked
                num_placeholders[request_id] = booked
