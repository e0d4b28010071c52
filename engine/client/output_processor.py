"""Turns the engine core's per-step outputs into the user-facing ``outputs`` objects.

A pure synchronous core (no bus, no asyncio): the engine client registers each request with
``add_request`` (which fans ``n > 1`` out into children ``f"{i}_{request_id}"`` with seed + i and
returns what to send to the engine core), feeds every ``EngineOutputs`` to ``process_outputs``,
routes the returned ``RequestOutput`` objects to their collectors, and tells the engine core to
abort ``reqs_to_abort`` (requests that ended on a stop string, which only this side can see).

Resumption (``resume_on_fault``): an output that says its engine core's fault ended it
(``resumable``) neither reaches the caller nor finishes the completion; its request is listed in
``to_resume``. ``prepare_resume`` then gives each unfinished completion a fresh engine-side id
(``"{id}@{attempt}"``, so late outputs of the old attempt are dropped as unknown) and returns what
to send again: the prompt and, per completion, the tokens received so far.

Lost outputs: each output says how many tokens its completion had before it
(``num_prior_tokens``); one that does not follow the tokens received (a bus connection cut
mid-stream lost the outputs between) is not taken: its engine-side request is aborted and, with
resumption, resumed from the tokens received, else failed.

Disaggregated prefill (``mark_remote_prefill``): a request sent to a prefill engine core ends
there capped at one token, its KV held; that output's token reaches the caller but its finish
does not, and the request is listed in ``to_hand_over`` with the held KV (``continuation``: what
to send the decode engine core), or, when its first token already ended it on a stop string, in
``to_release``.

Per completion (``completion_state``) it detokenizes incrementally, applies stop strings
with hold-back, converts logprobs and tracks what was already sent; per request it aggregates the
children into one output in the request's output kind and keeps latency timestamps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from shoal.bus.messages.engine import EngineCoreOutput, EngineOutputs, KVTransferParams
from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.pooling import PoolingParams
from shoal.bus.messages.sampling import OutputKind, SamplingParams
from shoal.engine.client.completion_state import CompletionState, convert_logprobs
from shoal.engine.client.outputs import RequestMetrics, RequestOutput, TokenLogprobs
from shoal.engine.client.tokenizer import Tokenizer

LOST_OUTPUTS = "outputs of the engine core were lost in transit"


@dataclass(slots=True, frozen=True)
class ChildRequest:
    """One request the engine core must run: the request itself when n == 1, else a child."""

    request_id: str
    sampling_params: SamplingParams


@dataclass(slots=True)
class ProcessedOutputs:
    """The result of one ``process_outputs`` call."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Engine-side ids that finished here on a stop string (or after lost outputs) while the
    # engine core still runs them.
    reqs_to_abort: list[str] = field(default_factory=list)
    # Requests (user ids) that finished in this batch and are no longer tracked.
    finished_request_ids: list[str] = field(default_factory=list)
    # Requests (user ids) whose completions a fault ended, to resume (``resume_on_fault``),
    # with the fault's error text.
    to_resume: dict[str, str] = field(default_factory=dict)
    # Requests (user ids) prefilled for a remote decode, to continue on a decode engine core
    # with the KV their prefill engine core holds (``mark_remote_prefill``).
    to_hand_over: dict[str, KVTransferParams] = field(default_factory=dict)
    # KV held for requests that will not continue (they ended on their first token here): to
    # release at the prefill engine core that holds it.
    to_release: list[tuple[str, str]] = field(default_factory=list)  # (engine id, request id)


@dataclass(slots=True, frozen=True)
class ResumeRequest:
    """What to send an engine core for a request: per unfinished completion, its engine-side
    request and the tokens it already produced (none on the first send; those of the cut
    attempt when sent again after a fault, or handed over), and what every add carries (its
    adapter, its pooling)."""

    prompt_token_ids: list[int]
    arrival_time: float
    priority: int
    children: list[tuple[ChildRequest, list[int]]]
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None
    trace_headers: dict[str, str] | None = None  # the client's span of it (W3C), when traced


def child_request_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


class RequestState:
    """One user request and its ``n`` completions."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        arrival_time: float,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.priority = priority
        self.lora_request = lora_request
        self.pooling_params = pooling_params
        self.pooled: list[float] | None = None  # a pooling request's embedding, at its end
        self.trace_headers: dict[str, str] | None = None  # its trace context, when traced
        self.num_attempts = 1  # sent once, plus one per resumption
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_kind = params.output_kind
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.tokenizer = tokenizer
        self.children: dict[str, CompletionState] = {}
        self.child_params: list[ChildRequest] = []
        for i in range(params.n):
            engine_id = request_id if params.n == 1 else child_request_id(i, request_id)
            child = _child_params(params, i)
            self.children[engine_id] = CompletionState(i, child, tokenizer, prompt_token_ids)
            self.child_params.append(ChildRequest(engine_id, child))
        self.prompt_logprob_rows: list[TokenLogprobs] = []
        self.num_cached_tokens = 0
        self.error: str | None = None
        self._prompt_logprobs_sent = False
        # Sent to a prefill engine core with max_tokens 1: its "length" finish is the handover.
        self.prefilling_remotely = False

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children.values())

    def payload(self, children: list[tuple[ChildRequest, list[int]]]) -> ResumeRequest:
        """What to send an engine core to run ``children`` (completions and their tokens)."""
        return ResumeRequest(
            self.prompt_token_ids,
            self.metrics.arrival_time,
            self.priority,
            children,
            self.lora_request,
            self.pooling_params,
            self.trace_headers,
        )

    def absorb_request_fields(self, output: EngineCoreOutput, child: CompletionState) -> None:
        if output.prompt_logprobs is not None and child.index == 0:
            self.prompt_logprob_rows += convert_logprobs(output.prompt_logprobs, self.tokenizer)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.error is not None:
            self.error = output.error
        if output.pooled is not None:
            self.pooled = output.pooled
        metrics = self.metrics
        if output.scheduled_time is not None:
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = output.scheduled_time
            elif metrics.handover_time is not None and metrics.decode_scheduled_time is None:
                metrics.decode_scheduled_time = output.scheduled_time  # (the continuation's)

    def record_times(self, has_new_tokens: bool, now: float) -> None:
        metrics = self.metrics
        if has_new_tokens:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            elif metrics.handover_time is not None and metrics.decode_first_token_time is None:
                metrics.decode_first_token_time = now
            metrics.last_token_time = now
        if self.finished and self.metrics.finished_time is None:
            self.metrics.finished_time = now

    def make_output(self, touched: Iterable[CompletionState]) -> RequestOutput | None:
        """The request's output after a batch that moved the ``touched`` completions."""
        finished = self.finished
        kind = self.output_kind
        if kind == OutputKind.FINAL_ONLY and not finished:
            return None
        if kind == OutputKind.DELTA:
            # A partial prefill moves nothing a consumer sees: its prompt logprobs wait for
            # the first token, so they reach a DELTA consumer whole, as in the other kinds.
            chosen = sorted((c for c in touched if c.has_news), key=lambda c: c.index)
        else:
            chosen = [c for c in self.children.values() if c.token_ids or c.finished]
        if not chosen and not finished:
            return None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.make_completion(kind) for c in chosen],
            finished=finished,
            prompt_logprobs=self._take_prompt_logprobs(),
            num_cached_tokens=self.num_cached_tokens,
            metrics=dataclasses.replace(self.metrics),
            error=self.error,
            pooled=self.pooled,
        )

    def _take_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        if self.params.prompt_logprobs is None:
            return None
        if self.output_kind == OutputKind.DELTA and self._prompt_logprobs_sent:
            return None
        self._prompt_logprobs_sent = True
        # Position 0 has no logprob; the rows describe positions 1.. in order.
        return [None, *self.prompt_logprob_rows]


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return msgspec.structs.replace(params, n=1, seed=seed)


class OutputProcessor:
    """All in-flight requests of one engine client."""

    def __init__(self, tokenizer: Tokenizer | None, resume_on_fault: bool = False) -> None:
        self.tokenizer = tokenizer
        self.resume_on_fault = resume_on_fault
        self._requests: dict[str, RequestState] = {}
        self._owner_of: dict[str, str] = {}  # engine-side id → user request id

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        trace_headers: dict[str, str] | None = None,
    ) -> list[ChildRequest]:
        """Track a request; returns the engine-side requests to send (one per completion).
        ``trace_headers``: the client's span of it, sent with every attempt's adds."""
        if request_id in self._requests:
            raise ValueError(f"request id already in flight: {request_id!r}")
        arrival = time.time() if arrival_time is None else arrival_time
        state = RequestState(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            self.tokenizer,
            arrival,
            priority,
            lora_request,
            pooling_params,
        )
        state.trace_headers = trace_headers
        self._requests[request_id] = state
        for child in state.child_params:
            self._owner_of[child.request_id] = request_id
        return list(state.child_params)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def engine_request_ids(self, request_id: str) -> list[str]:
        """The engine-side ids of a request's completions that are still running."""
        state = self._requests.get(request_id)
        if state is None:
            return []
        return [eid for eid, c in state.children.items() if not c.finished]

    def process_outputs(
        self, outputs: EngineOutputs | list[EngineCoreOutput], now: float | None = None
    ) -> ProcessedOutputs:
        """Absorb one step's outputs (unknown or already finished ids are ignored)."""
        now = time.time() if now is None else now
        items = outputs.outputs if isinstance(outputs, EngineOutputs) else outputs
        result = ProcessedOutputs()
        touched: dict[str, list[CompletionState]] = {}
        for item in items:
            owner = self._owner_of.get(item.request_id)
            if owner is None:
                continue
            state = self._requests[owner]
            child = state.children[item.request_id]
            if child.finished:
                continue
            if item.resumable and self.resume_on_fault:
                result.to_resume.setdefault(owner, item.error or "engine core fault")
                continue
            if _follows_a_gap(item, child):
                result.reqs_to_abort.append(item.request_id)  # its engine core goes on otherwise
                if self.resume_on_fault:
                    result.to_resume.setdefault(owner, LOST_OUTPUTS)
                    continue
                item = EngineCoreOutput(item.request_id, [], "error", error=LOST_OUTPUTS)
            handover = _handover_of(state, item)
            if handover is not None:  # the prefill's end is not the request's
                state.prefilling_remotely = False
                item = msgspec.structs.replace(item, finish_reason=None, kv_transfer_params=None)
            stopped_here = child.update(item)
            state.absorb_request_fields(item, child)
            state.record_times(bool(item.new_token_ids), now)
            touched.setdefault(owner, []).append(child)
            if handover is not None:
                if child.finished:  # on a stop string in its first token
                    result.to_release.append((handover.remote_engine_id, item.request_id))
                else:
                    result.to_hand_over[owner] = handover
                    state.metrics.handover_time = now
            if child.finished:
                del self._owner_of[item.request_id]
                if stopped_here and item.finish_reason is None and handover is None:
                    result.reqs_to_abort.append(item.request_id)
        for owner, children in touched.items():
            state = self._requests[owner]
            request_output = state.make_output(children)
            if request_output is not None:
                result.request_outputs.append(request_output)
            if state.finished:
                self._drop(owner)
                result.finished_request_ids.append(owner)
        return result

    def mark_remote_prefill(self, request_id: str) -> None:
        """The request was sent to a prefill engine core (max_tokens 1, held KV): its first
        output's "length" finish hands it over (``ProcessedOutputs.to_hand_over``)."""
        self._requests[request_id].prefilling_remotely = True

    def continuation(self, request_id: str) -> ResumeRequest | None:
        """What to send a decode engine core for a handed-over request: its completion under
        the same engine-side id, with the token it has (None if no longer tracked)."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        children = [
            (ChildRequest(eid, c.params), list(c.token_ids))
            for eid, c in state.children.items()
            if not c.finished
        ]
        return state.payload(children)

    def owner_of(self, engine_request_id: str) -> str | None:
        """The user request an engine-side id belongs to (None once finished or replaced)."""
        return self._owner_of.get(engine_request_id)

    def prepare_resume(self, request_id: str) -> ResumeRequest | None:
        """Re-key the request's unfinished completions for one more attempt (outputs under
        their old ids are ignored from now on); what to send. None if not tracked."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        attempt, state.num_attempts = state.num_attempts, state.num_attempts + 1
        state.prefilling_remotely = False  # resumed whole, on an engine core that decodes
        children: list[tuple[ChildRequest, list[int]]] = []
        rekeyed: dict[str, CompletionState] = {}  # in the same (index) order
        for old_id, child in state.children.items():
            if child.finished:
                rekeyed[old_id] = child
                continue
            new_id = f"{state.child_params[child.index].request_id}@{attempt}"
            rekeyed[new_id] = child
            self._owner_of.pop(old_id, None)
            self._owner_of[new_id] = request_id
            children.append((ChildRequest(new_id, child.params), list(child.token_ids)))
            if child.index == 0 and not child.token_ids:
                state.prompt_logprob_rows = []  # the prompt is run whole again, with its rows
        state.children = rekeyed
        return state.payload(children)

    def abort_request(self, request_id: str) -> list[str]:
        """Stop tracking a request; returns its engine-side ids that were still running."""
        running = self.engine_request_ids(request_id)
        self._drop(request_id)
        return running

    def fail_request(
        self, request_id: str, error: str, now: float | None = None
    ) -> RequestOutput | None:
        """End a request with an error (e.g. its engine core died); its final output, if tracked."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        unfinished = [c for c in state.children.values() if not c.finished]
        for child in unfinished:
            child.finish_reason = "error"
        state.error = error
        state.record_times(False, time.time() if now is None else now)
        self._drop(request_id)
        return state.make_output(unfinished)

    def _drop(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        for engine_id in state.children:
            self._owner_of.pop(engine_id, None)


def _follows_a_gap(item: EngineCoreOutput, child: CompletionState) -> bool:
    """The output's tokens do not come right after the completion's: outputs between were lost
    in transit (or it repeats some), so its tokens cannot be taken as the next ones."""
    prior = item.num_prior_tokens
    return bool(item.new_token_ids) and prior >= 0 and prior != len(child.token_ids)


def _handover_of(state: RequestState, item: EngineCoreOutput) -> KVTransferParams | None:
    """The held KV of a remote prefill's final output (None: not one)."""
    params = item.kv_transfer_params
    if (
        not state.prefilling_remotely
        or item.finish_reason != "length"
        or params is None
        or not params.do_remote_decode
    ):
        return None
    return params
