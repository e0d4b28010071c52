"""What the scheduler needs from a grammar engine (structured outputs), as a protocol, so the
engine core stays pure: ``engine/structured`` implements it with xgrammar, compiling off the
engine core's loop, and the shell hands it in.

A request with ``structured_outputs`` waits apart (``GrammarParking``) until its grammar is
compiled, then queues like any other; each step that it samples in carries its row of the token
bitmask (``GrammarBitmask``); its sampled tokens advance its matcher as they land. Under async
scheduling its next step is scheduled before its previous token lands, and that step's mask
depends on the token: the step goes without its masks (``grammar_later``) and they follow it
(``StepGrammar``, made by ``late_grammar`` once the step before has landed) while the worker
runs the step's forward pass (vLLM's deferred sampling for ``pending_structured_output_tokens``).
Under speculative decoding it verifies only the drafts its grammar accepts (the
longest valid prefix), with one bitmask row per position verified (after each draft, then the
bonus position); its matcher is rolled back after filling them and advanced by the tokens that
land.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from shoal.bus.messages.structured import GrammarBitmask, StepGrammar, StructuredOutputsParams
from shoal.engine.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from shoal.engine.core.scheduler_output import SchedulerOutput
    from shoal.engine.core.step_outcome import StepOutcome


class GrammarState(enum.Enum):
    COMPILING = "compiling"
    READY = "ready"
    FAILED = "failed"


class GrammarBackend(Protocol):
    """Matchers of the requests under a grammar, by request id."""

    def start(
        self, request_id: str, params: StructuredOutputsParams, output_token_ids: Sequence[int]
    ) -> None:
        """Compile (or find compiled) the grammar of ``params`` for ``request_id``; its matcher
        then accepts ``output_token_ids`` first (a request resumed with output so far)."""

    def state(self, request_id: str) -> tuple[GrammarState, str]:
        """Where its compilation is, and the error when it failed."""
        ...

    def accept(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Advance its matcher; False if the grammar refuses a token (it stays before it)."""
        ...

    def valid_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (drafts) its grammar accepts in a row from where its
        matcher is (which stays there)."""
        ...

    def bitmask(
        self, request_ids: Sequence[str], drafts: Mapping[str, Sequence[int]]
    ) -> GrammarBitmask:
        """The rows of these (ready) requests, in this order: one per request, or with drafts
        ``n + 1`` (after each of its ``n`` drafts in turn; the matcher ends where it began)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget its matcher (finished, or failed)."""


class GrammarParking:
    """Requests whose grammar is compiling, in arrival order."""

    def __init__(self, backend: GrammarBackend) -> None:
        self.backend = backend
        self.parked: dict[str, Request] = {}  # request id → the request (insertion order)
        self.num_active = 0  # requests with a grammar not finished yet (0: steps skip it all)

    def __len__(self) -> int:
        return len(self.parked)

    def park(self, request: Request) -> None:
        structured = request.sampling_params.structured_outputs
        assert structured is not None
        self.backend.start(request.request_id, structured, request.output_token_ids)
        self.parked[request.request_id] = request
        self.num_active += 1

    def num_valid_drafts(self, request: Request, num_drafts: int) -> int:
        """Of a sampling request's first ``num_drafts`` drafts, how many to verify: all for a
        free request, its grammar's valid prefix for one with a grammar, all when they are not
        known yet (async scheduling: the worker verifies them blind; a step's late masks stop
        at the first one the grammar refuses, so it is rejected)."""
        drafts = request.spec_token_ids[:num_drafts]
        if not grammar_bound(request) or any(draft < 0 for draft in drafts):
            return num_drafts  # (placeholders: verified blind, their rows made once known)
        return self.backend.valid_prefix(request.request_id, drafts)

    def release(self, request: Request) -> None:
        """``request`` is finished: its matcher goes (if it had a grammar)."""
        if grammar_bound(request):
            self.backend.release(request.request_id)
            self.num_active -= 1

    def unpark(self, request: Request) -> bool:
        """Take ``request`` off the parking (aborted); whether it was there."""
        return self.parked.pop(request.request_id, None) is not None

    def admit(
        self,
        queue: Callable[[Request], None],
        release: Callable[[Request, bool], None],
    ) -> list[Request]:
        """``queue`` each parked request whose grammar is ready; finish each whose grammar
        failed (``FINISHED_ERROR`` with the error; ``release(request, was_on_worker)``) and
        return those."""
        if not self.parked:
            return []
        ready, failed = self.take_done()
        for request in ready:
            queue(request)
        for request, error in failed:
            request.error = error
            request.status = RequestStatus.FINISHED_ERROR
            release(request, False)
        return [request for request, _ in failed]

    def take_done(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The parked requests whose grammar is ready, and those whose compile failed (with
        the error), each taken off the parking."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for request_id, request in list(self.parked.items()):
            state, error = self.backend.state(request_id)
            if state is GrammarState.COMPILING:
                continue
            del self.parked[request_id]
            if state is GrammarState.READY:
                ready.append(request)
            else:
                failed.append((request, error))
        return ready, failed


def grammar_bound(request: Request) -> bool:
    """Whether ``request``'s output is constrained by a grammar."""
    return request.sampling_params.structured_outputs is not None


def plan_grammar(backend: GrammarBackend, output: SchedulerOutput) -> None:
    """Give the step the bitmask rows of its requests under a grammar that sample in it, or,
    when one of them still has a token in flight (async scheduling), mark them for later;
    none: no bitmask, so steps without such requests cost nothing. Call it before the step's
    drafts become placeholders (``SpecDecoding.after_schedule``)."""
    bound = [rid for rid in output.sampling_req_ids if grammar_bound(output.requests[rid])]
    if not bound:
        return
    output.grammar_drafts = {
        rid: output.requests[rid].spec_token_ids[: output.num_spec_tokens[rid]]
        for rid in bound
        if rid in output.num_spec_tokens
    }
    if any(_token_in_flight(output, rid) for rid in bound):
        output.grammar_later = True
    else:
        output.grammar = backend.bitmask(bound, output.grammar_drafts)


def late_grammar(
    backend: GrammarBackend,
    output: SchedulerOutput,
    requests: Mapping[str, Request],
    landed_drafts: Mapping[str, Sequence[int]],
) -> StepGrammar:
    """The masks of a ``grammar_later`` step, once the step before it has landed (every token
    they depend on is in the matchers; ``landed_drafts``: the drafts it proposed, which this
    step verifies blind); requests that ended meanwhile get none."""
    live = [
        rid
        for rid in output.sampling_req_ids
        if grammar_bound(output.requests[rid])
        and requests.get(rid) is output.requests[rid]
        and output.requests[rid].status is RequestStatus.RUNNING
    ]
    drafts = dict(output.grammar_drafts)
    for rid in live:
        scheduled = drafts.get(rid, [])
        if any(draft < 0 for draft in scheduled):  # blind: their values came with the landing
            known = list(landed_drafts.get(rid, ()))[: len(scheduled)]
            drafts[rid] = known + [-1] * (len(scheduled) - len(known))
    bitmask = backend.bitmask(live, drafts) if live else None
    return StepGrammar(output.step_id, bitmask)


def _token_in_flight(output: SchedulerOutput, request_id: str) -> bool:
    """Whether the request has a token from an earlier step still in flight (an output
    placeholder beyond the one this step booked)."""
    request = output.requests[request_id]
    return request.num_output_placeholders > output.num_placeholders.get(request_id, 0)


def advance_matchers(
    backend: GrammarBackend, requests: Mapping[str, Request], outcome: StepOutcome
) -> None:
    """Feed each grammar-bound request's new tokens to its matcher. A token the grammar
    refuses (its bitmask was not applied) fails the request, unless it stopped on it."""
    stopped = {request.request_id for request in outcome.stopped}
    for client_outputs in list(outcome.outputs.values()):
        for output in list(client_outputs):
            request = requests.get(output.request_id)
            if request is None or not grammar_bound(request) or not output.new_token_ids:
                continue
            if backend.accept(request.request_id, output.new_token_ids):
                continue
            if request.request_id in stopped or request in outcome.failed:
                continue
            request.error = "a sampled token does not match the request's grammar"
            outcome.failed.append(request)
            client_outputs.append(request.make_final_output(RequestStatus.FINISHED_ERROR))
