"""Engine client ↔ engine core messages.

Inbox of an engine core: ``EngineInbound`` (add, abort). The engine core publishes one
``EngineOutputs`` per step per client on that client's output subject, and ``EngineStats`` on
its stats subject for routing and metrics.
"""

from __future__ import annotations

import msgspec

from shoal.bus.messages.kv_handover import KVExportRef
from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.pooling import PoolingParams
from shoal.bus.messages.sampling import SamplingParams


class Logprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Log-probabilities for a run of positions.

    Row ``i`` describes position ``i``: ``token_ids[i][0]`` is the token actually there (sampled
    or given), followed by the top-n candidates; ``logprobs[i]`` is aligned with it and
    ``ranks[i]`` is the rank (1 = most likely) of the actual token.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


# How long a prefill engine core holds prompt KV nobody pulls, by default (vLLM's
# VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
DEFAULT_KV_LEASE_S = 480.0


class KVTransferParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Disaggregated prefill (vLLM's ``kv_transfer_params``).

    Asked of a prefill engine core with ``do_remote_decode``: it runs the prompt, and when the
    request ends capped by ``max_tokens`` it holds the prompt's KV blocks (one reference each)
    for a decode engine core to pull, answering in the request's final output with
    ``remote_engine_id``, ``remote_block_ids`` and ``num_remote_tokens`` (the prompt tokens
    whose KV those blocks hold, in order) and ``remote_kv`` (its workers' exported caches),
    until a ``ReleaseKV`` or its lease ends.

    Given to a decode engine core with ``do_remote_prefill`` (the same fields): it admits the
    request with those tokens' KV pulled from the prefill side's workers instead of computed
    (``bus.messages.kv_handover``), then sends ``ReleaseKV`` there."""

    do_remote_decode: bool = False
    remote_block_ids: list[int] = []
    num_remote_tokens: int = 0
    do_remote_prefill: bool = False
    remote_engine_id: str = ""
    remote_kv: list[KVExportRef] = []
    lease_s: float = DEFAULT_KV_LEASE_S  # how long the prefill side holds the KV, from its answer


class AddRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True, gc=False):
    """A new request for an engine core. ``client_id`` names the output subject to answer on."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    client_id: str
    arrival_time: float
    eos_token_ids: list[int] = []
    priority: int = 0
    cache_salt: str | None = None
    # A request resumed after a fault: the tokens already generated (and streamed) elsewhere.
    # The engine core takes them as the request's output so far (recomputed with the prompt,
    # counted against max_tokens, seen by stop checks and penalties) and continues after them.
    output_token_ids: list[int] = []
    kv_transfer_params: KVTransferParams | None = None
    lora_request: LoRARequest | None = None  # the adapter to run it with (multi-LoRA)
    pooling_params: PoolingParams | None = None  # an embedding: the prompt's pooled state


class AbortRequest(msgspec.Struct, tag="abort", array_like=True, omit_defaults=True, gc=False):
    """Stop these requests now; unknown or finished ids are ignored (abort is idempotent)."""

    request_ids: list[str]


class ReleaseKV(msgspec.Struct, tag="release_kv", array_like=True, gc=False):
    """The KV these requests' prefill held for a remote decode is no longer needed (pulled, or
    given up): free it. Unknown ids are ignored (a lease may have ended first)."""

    request_ids: list[str]


EngineInbound = AddRequest | AbortRequest | ReleaseKV


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request: new tokens and, at the end, why it stopped.

    ``finish_reason`` is one of ``stop``, ``length``, ``abort``, ``error`` or None while running;
    ``stop_reason`` is the stop token id that ended it (stop strings are the client's business).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    scheduled_time: float | None = None  # wall clock of first admission, on the first output
    # Ended by a fault of the engine core (its sentinel aborted everything), not by anything in
    # the request: the client may resume it on a healthy engine core.
    resumable: bool = False
    # On the final output of a request prefilled for a remote decode: where its KV is held.
    kv_transfer_params: KVTransferParams | None = None
    pooled: list[float] | None = None  # a pooling request's embedding, on its final output
    # Output tokens the request had before these (-1: not said): a client that has fewer lost
    # outputs in transit (a bus connection cut mid-stream) and must not take these as next.
    num_prior_tokens: int = -1


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Load and cache figures of one engine core after a step (cumulative counters)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    step_id: int = 0
    # Step timing at the engine core (cumulative): wall time from sending a step to having its
    # result, the workers' own execute time, and the number of steps sent. Their difference per
    # step is what the bus and the worker shell cost (with async scheduling it also holds the
    # time a step waits on the worker behind the one before it).
    step_wall_s: float = 0.0
    worker_execute_s: float = 0.0
    num_worker_steps: int = 0
    # Requests finished, by finish reason (cumulative), and the KV blocks free now: what the
    # engine core itself saw of aborts and stops, readable from another process.
    num_finished_stop: int = 0
    num_finished_length: int = 0
    num_finished_abort: int = 0
    num_finished_error: int = 0
    num_free_blocks: int = 0
    # Async scheduling, from the engine core actor: the worker's idle time between steps while
    # this engine core had work (cumulative, as the worker measures it: its previous result
    # handed back → next step started), the steps in flight now and the most seen at once, and
    # every token scheduled (cumulative; exactly prompt + max_tokens - 1 per request run to its
    # length without preemption or cache hits).
    worker_idle_s: float = 0.0
    num_steps_in_flight: int = 0
    max_steps_in_flight: int = 0
    num_scheduled_tokens: int = 0
    # KV offload (cumulative, except the usage): tokens looked up in the tiers and found there
    # (beyond the local prefix cache), bytes and seconds of the workers' copies, chunks whose
    # store was dropped (backpressure, no room), lookups that failed or timed out (the request
    # recomputed), and the CPU tier's usage last reported (0.0 to 1.0).
    kv_offload_queries: int = 0
    kv_offload_hits: int = 0
    kv_offload_load_bytes: int = 0
    kv_offload_load_time_s: float = 0.0
    kv_offload_store_bytes: int = 0
    kv_offload_store_time_s: float = 0.0
    kv_offload_stores_skipped: int = 0
    kv_offload_lookup_failures: int = 0
    kv_offload_cpu_usage: float = 0.0
    # Disaggregated prefill (cumulative, except the holds now). Prefill side: prompt KV holds
    # made, released by their decode side, ended by their lease, and held now. Decode side:
    # pulls landed and failed, tokens pulled and (failed pulls) recomputed instead, the workers'
    # bytes and seconds.
    kv_handover_holds: int = 0
    kv_handover_released: int = 0
    kv_handover_expired: int = 0
    kv_handover_holding: int = 0
    kv_pulls: int = 0
    kv_pull_failures: int = 0
    kv_pulled_tokens: int = 0
    kv_pull_recomputed_tokens: int = 0
    kv_pull_bytes: int = 0
    kv_pull_time_s: float = 0.0
    kv_pull_late: int = 0  # remote prefills not pulled: admitted too late in their hold's lease
    # Speculative decoding (cumulative, vLLM's SpecDecodingStats): requests that verified drafts
    # (one per request and step), drafts verified, drafts accepted, and accepted drafts by
    # position (index i: the (i+1)-th draft of a run); the K the engine core asks for now.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    spec_decode_k: int = 0
    # LoRA (vLLM's lora_requests_info): the adapters of the running and waiting requests, those
    # its workers' slots hold (as its steps tell), and how many slots they have.
    lora_running: list[str] = []
    lora_waiting: list[str] = []
    lora_resident: list[str] = []
    max_loras: int = 0


class EngineOutputs(msgspec.Struct, tag="outputs", array_like=True, omit_defaults=True, gc=False):
    """One step's outputs for one client of one engine core."""

    engine_id: str
    outputs: list[EngineCoreOutput]
    timestamp: float
    stats: SchedulerStats | None = None


class RequestRejected(msgspec.Struct, tag="rejected", array_like=True, omit_defaults=True):
    """An add the engine core could not take. ``code``: ``overloaded`` | ``invalid`` |
    ``unavailable`` (faulted or recovering: the client may send it to another engine core)."""

    request_id: str
    code: str
    message: str


class EngineStats(msgspec.Struct, tag="stats", array_like=True, omit_defaults=True):
    """Published after steps for load-aware routing and metrics."""

    engine_id: str
    stats: SchedulerStats
    timestamp: float
    max_model_len: int = 0
    num_blocks: int = 0
    block_size: int = 0
    incarnation: str = ""  # the engine core actor's (see control.Heartbeat)
    kv_tier_id: str = ""  # the CPU tier it loads offloaded KV from ("": offload off)
    kv_role: str = "both"  # disaggregated prefill: "prefill", "decode" or "both"


EngineOutbound = EngineOutputs | RequestRejected
