"""What the engine client hands to its users (the offline API, the gateway): vLLM's shapes.

``RequestOutput.outputs[i]`` is one of the ``n`` completions of a prompt. Depending on the
request's ``output_kind``, ``text``/``token_ids`` are cumulative (everything so far) or deltas
(only what is new since the previous output); a FINAL_ONLY request yields a single output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's log-probabilities: token id → (logprob, rank, decoded token).
TokenLogprobs = dict[int, "Logprob"]


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of a request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Prefilled on a prefill engine core (disaggregated prefill): when its prefill's output
    # handed it over, when the decode engine core admitted it (and pulled its KV), and when the
    # decode side's first token arrived.
    handover_time: float | None = None
    decode_scheduled_time: float | None = None
    decode_first_token_time: float | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    extra: dict[str, object] = field(default_factory=dict)
    pooled: list[float] | None = None  # a pooling request's embedding, once finished


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """vLLM's ``LLM.embed`` result: the prompt and its embedding."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
