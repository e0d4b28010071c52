"""The engine-side request: its tokens, its progress and its lifecycle.

A request holds ``all_token_ids`` (prompt then outputs) and ``num_computed_tokens``, the number
of them whose KV is in the cache (or scheduled to be); the scheduler makes the second catch up
with the first. ``block_hashes`` grows through the block hasher as blocks fill up.

Resumption after a fault: a request may arrive with output tokens generated elsewhere
(``AddRequest.output_token_ids``). They are its output so far (``num_resumed_tokens`` of them):
recomputed with the prompt like a preempted request's, counted against ``max_tokens`` and
``max_model_len``, seen by stop checks, penalties and min_tokens; only tokens after them are
published.

Statuses are ordered as in vLLM: everything above ``PREEMPTED`` is finished, and each finished
status maps to a wire finish reason (``stop``, ``length``, ``abort``, ``error``).

Async scheduling: ``num_output_placeholders`` counts tokens already scheduled for sampling whose
values are not back yet (the scheduler treats them as computed); ``num_in_flight_steps`` and
``num_in_flight_tokens`` count the steps (and their tokens) sent with this request whose results
have not been applied; ``num_stale_steps`` counts the oldest of those whose output is to be
ignored (the request was preempted after they were sent). All stay zero between steps when one
step at a time is in flight.

Speculative decoding: ``spec_token_ids`` are what the engine core knows of the request's latest
drafts (``spec_decoding.py``): their values, or -1 placeholders while the step proposing them is
in flight.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterable
from typing import Protocol

from shoal.bus.messages.engine import AddRequest, EngineCoreOutput, KVTransferParams
from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.pooling import PoolingParams
from shoal.bus.messages.sampling import SamplingParams


class BlockHasherFn(Protocol):
    """What a request needs from its block hasher (``block_hash.BlockHasher``)."""

    block_size: int

    def __call__(self, request: Request) -> list[bytes]: ...


NO_TOKEN_LIMIT = sys.maxsize


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6
    FINISHED_ERROR = 7

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    def __str__(self) -> str:
        return self.name


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One request as the scheduler sees it. Ordered by (priority, arrival, id) for the heap."""

    __slots__ = (
        "_block_hasher",
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "client_id",
        "eos_token_ids",
        "error",
        "first_scheduled_time",
        "hands_kv_over",
        "lora_request",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_in_flight_steps",
        "num_in_flight_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "num_resumed_tokens",
        "num_stale_steps",
        "output_token_ids",
        "pooling_params",
        "priority",
        "prompt_token_ids",
        "remote_prefill",
        "request_id",
        "sampling_params",
        "spec_token_ids",
        "status",
        "stop_eos_ids",
        "stop_reason",
        "stop_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        client_id: str = "",
        arrival_time: float = 0.0,
        eos_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        block_hasher: BlockHasherFn | None = None,
        output_token_ids: list[int] | None = None,
        hands_kv_over: bool = False,
        remote_prefill: KVTransferParams | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.request_id = request_id
        self.client_id = client_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # its adapter: in its block hashes, on its worker
        self.pooling_params = pooling_params  # an embedding request: its prompt's pooled state
        self.eos_token_ids: list[int] = list(eos_token_ids or [])
        # The ids that end the request when sampled (eos unless ignore_eos).
        self.stop_eos_ids = frozenset(() if sampling_params.ignore_eos else self.eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self.max_tokens = sampling_params.max_tokens or NO_TOKEN_LIMIT
        self.status = RequestStatus.WAITING
        # A request resumed after a fault arrives with its output so far (generated elsewhere).
        self.output_token_ids: list[int] = list(output_token_ids or ())
        self.all_token_ids: list[int] = [*prompt_token_ids, *self.output_token_ids]
        self.num_resumed_tokens = len(self.output_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0  # scheduled for sampling, values not back yet
        self.num_in_flight_steps = 0  # steps sent with this request, results not applied
        self.num_in_flight_tokens = 0  # their scheduled tokens (not stale)
        self.num_stale_steps = 0  # the oldest in-flight steps, sent before a preemption
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 before it
        self.first_scheduled_time: float | None = None  # wall clock of the first admission
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.spec_token_ids: list[int] = []  # latest drafts (-1: not known yet)
        # Prefilled for a remote decode: its prompt's KV is held once it ends (kv_handover.py).
        self.hands_kv_over = hands_kv_over
        # Prefilled on a remote engine core that holds its prompt's KV (remote_prefill.py).
        self.remote_prefill = remote_prefill
        self.block_hashes: list[bytes] = []
        self._block_hasher: BlockHasherFn | None = None
        if block_hasher is not None:
            self.set_block_hasher(block_hasher)

    @classmethod
    def from_add(cls, msg: AddRequest, block_hasher: BlockHasherFn | None = None) -> Request:
        """The request an ``AddRequest`` message describes."""
        return cls(
            msg.request_id,
            msg.prompt_token_ids,
            msg.sampling_params,
            client_id=msg.client_id,
            arrival_time=msg.arrival_time,
            eos_token_ids=msg.eos_token_ids,
            priority=msg.priority,
            cache_salt=msg.cache_salt,
            block_hasher=block_hasher,
            output_token_ids=msg.output_token_ids,
            hands_kv_over=msg.kv_transfer_params is not None
            and msg.kv_transfer_params.do_remote_decode,
            remote_prefill=remote_prefill_of(msg.kv_transfer_params),
            lora_request=msg.lora_request,
            pooling_params=msg.pooling_params,
        )

    def set_block_hasher(self, block_hasher: BlockHasherFn) -> None:
        self._block_hasher = block_hasher
        self.block_hashes.extend(block_hasher(self))

    @property
    def has_block_hasher(self) -> bool:
        return self._block_hasher is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_landed_tokens(self) -> int:
        """Tokens whose KV a step has written and reported (computed, not in flight)."""
        return self.num_computed_tokens - self.num_in_flight_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def is_resumed(self) -> bool:
        """Recomputed with outputs it already has (preempted, or resumed after a fault): the
        worker gets them with the prompt and produces no prompt logprobs again."""
        return self.status is RequestStatus.PREEMPTED or self.num_resumed_tokens > 0

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs and pooling need every prompt position computed, so no cache hit is
        taken (a request resumed after a fault produces no prompt logprobs: its first run
        did)."""
        if self.pooling_params is not None:
            return True
        return self.sampling_params.prompt_logprobs is not None and not self.num_resumed_tokens

    def append_output_token_id(self, token_id: int) -> None:
        """Add one sampled token; hash the block it fills, if it fills one."""
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        hasher = self._block_hasher
        if hasher is not None and len(self.all_token_ids) % hasher.block_size == 0:
            self.block_hashes.extend(hasher(self))

    def make_final_output(self, status: RequestStatus | None = None) -> EngineCoreOutput:
        """The output that tells a client this request ended without new tokens (abort, error).

        ``status``: the finished status it is about to get, when that is not set yet.
        """
        return EngineCoreOutput(
            self.request_id,
            [],
            finish_reason=self.finish_reason if status is None else FINISH_REASONS[status],
            stop_reason=self.stop_reason,
            num_cached_tokens=max(self.num_cached_tokens, 0),
            error=self.error,
        )

    def __lt__(self, other: Request) -> bool:
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


ClientOutputs = dict[str, list[EngineCoreOutput]]  # outputs to publish, by client id


def merge_outputs(into: ClientOutputs, more: ClientOutputs) -> ClientOutputs:
    """``more`` appended to ``into``, client by client (``into``, returned)."""
    for client_id, outputs in more.items():
        into.setdefault(client_id, []).extend(outputs)
    return into


def group_final_outputs(requests: Iterable[Request]) -> ClientOutputs:
    """Final outputs of finished requests (``Request.make_final_output``), keyed by client id."""
    outputs: ClientOutputs = {}
    for request in requests:
        outputs.setdefault(request.client_id, []).append(request.make_final_output())
    return outputs


def remote_prefill_of(params: KVTransferParams | None) -> KVTransferParams | None:
    """``params`` if they give a remote prefill's KV to pull, else None."""
    if params is None or not params.do_remote_prefill or not params.remote_block_ids:
        return None
    return params
