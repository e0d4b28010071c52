"""The engine core's side of speculative decoding: how many drafts each request verifies, the K
the workers propose after each step, rejected drafts rolled back, and the acceptance counters.

Drafts are proposed by the workers after sampling and kept there (``bus.messages.worker``); a
request's ``spec_token_ids`` are what the engine core knows of its latest drafts: their values
once the step that proposed them has landed, or ``-1`` placeholders (as many as the K asked
for) while that step is in flight (async scheduling: the next step is scheduled before they are
known, and verifies the worker's drafts blind; a placeholder the worker cannot fill is padded
and rejected).

A request verifies drafts when it is scheduled to the end of its known tokens (it samples): as
many as it has, within the token budget, ``max_model_len`` and ``max_tokens`` (never more than
the step may emit). They are counted as scheduled tokens; the KV slots are allocated with them
(plus ``num_lookahead_slots`` for a draft model, which writes its own KV past them).

K, the drafts to propose after a step: ``num_speculative_tokens``, or the batch-size table's
K for the number of requests scheduled (vLLM's dynamic SD; an empty step keeps K), or with
``acceptance_driven_k`` the acceptance controller's K bounded by that (``spec_k.py``).

When a result lands, ``accept`` rolls back the rejected drafts (``num_computed_tokens``, whose
KV slots then get overwritten) before the tokens are appended and stop-checked one by one, and
counts acceptance as vLLM's ``SpecDecodingStats``: padded drafts count as drafted and rejected.
"""

from __future__ import annotations

from shoal.config.speculative import SpeculativeConfig
from shoal.engine.core.request import Request
from shoal.engine.core.scheduler_output import SchedulerOutput
from shoal.engine.core.spec_k import AcceptanceController
from shoal.engine.core.spec_schedule import build_spec_lookup

PLACEHOLDER_DRAFT = -1


class SpecDecoding:
    """Draft scheduling, K and acceptance for one scheduler."""

    def __init__(self, config: SpeculativeConfig, max_num_seqs: int, max_model_len: int) -> None:
        self.max_k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        schedule = config.num_speculative_tokens_per_batch_size
        self.lookup = (
            build_spec_lookup(schedule, max_num_seqs, self.max_k) if schedule is not None else None
        )
        self.controller = AcceptanceController(self.max_k) if config.acceptance_driven_k else None
        self.num_lookahead_slots = config.num_lookahead_slots
        self.k = self.max_k  # drafts the workers propose after the step being scheduled
        self.num_drafts = 0  # request-steps that verified drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.max_k
        self._step_accepted = 0  # this landing's totals, for the controller
        self._step_rejections = 0

    # ----- scheduling

    def num_drafts_to_verify(self, request: Request, num_known: int, budget: int) -> int:
        """Drafts a request that samples this step verifies: the ones it has, within the token
        ``budget`` left, the room left to emit (``max_model_len``, ``max_tokens``) and, with
        acceptance-driven K, the drafts the controller finds worth verifying now;
        ``num_known`` counts its output placeholders."""
        num_drafts = len(request.spec_token_ids)
        if not num_drafts:
            return 0
        if self.controller is not None:
            num_drafts = min(num_drafts, self.controller.num_worth_verifying())
        room_in_model = self.max_model_len - num_known - 1
        room_in_outputs = request.max_tokens - (num_known - request.num_prompt_tokens) - 1
        return max(0, min(num_drafts, budget, room_in_model, room_in_outputs))

    def num_lookahead(self, request: Request, num_tokens_after_step: int) -> int:
        """KV slots a draft model writes past a sampling request's step, within the model and
        the request's own end (prompt + ``max_tokens``, what admission checked fits)."""
        end = min(self.max_model_len, request.num_prompt_tokens + request.max_tokens)
        return max(0, min(self.num_lookahead_slots, end - num_tokens_after_step))

    def after_schedule(self, output: SchedulerOutput) -> None:
        """Choose K for the drafts proposed after this step, and give each request that samples
        in it K placeholder drafts: the result replaces them (``take_drafts``) unless a later
        step in flight already stands for newer ones."""
        num_requests = len(output.num_scheduled_tokens)
        if num_requests:
            bound = self.max_k if self.lookup is None else self.lookup[num_requests]
            self.k = bound if self.controller is None else self.controller.choose(bound)
        output.num_spec_tokens_to_propose = self.k
        for request_id in output.sampling_req_ids:
            output.requests[request_id].spec_token_ids = [PLACEHOLDER_DRAFT] * self.k

    # ----- results

    def accept(self, request: Request, num_verified: int, num_emitted: int) -> None:
        """Roll back a request's rejected drafts (``num_emitted``: tokens its result carries,
        the accepted drafts then the target's own) and count its acceptance."""
        num_accepted = max(0, min(num_emitted - 1, num_verified))
        request.num_computed_tokens -= num_verified - num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_verified
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for position in range(num_accepted):
            per_pos[position] += 1
        self._step_accepted += num_accepted
        self._step_rejections += num_accepted < num_verified

    @staticmethod
    def take_drafts(request: Request, drafts: list[int]) -> None:
        """The drafts a landed step proposed, unless a later step in flight already stands for
        newer ones (async scheduling)."""
        if not request.num_in_flight_steps:
            request.spec_token_ids = drafts

    def end_landing(self) -> None:
        """A step's result is applied: the controller sees its totals."""
        if self.controller is not None:
            self.controller.observe(self._step_accepted, self._step_rejections)
        self._step_accepted = self._step_rejections = 0
