"""The worker's per-request state: one ``CachedRequestState`` per request in the persistent
batch, created and dropped only by ``RequestStore`` (which also hands out batch rows).

Both per-step builders read it: ``InputBatch`` (a request's row of the batch arrays) and
``SamplingBatch`` (sampling params, token ids for penalties, stop ids for min_tokens, the seeded
generator); the runner reads it for prompt logprobs and appends the tokens it samples.

A preempted request's generator is parked when it leaves and handed back when it resumes, so its
random stream goes on from where it stopped. ``version`` changes with every add and remove, so
per-step caches know when to rebuild.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.sampling import SamplingParams


@dataclass(slots=True, eq=False)
class CachedRequestState:
    """What the worker keeps of one request outside the batch arrays."""

    req_id: str
    row: int  # of the persistent batch arrays
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # every output so far (resumed: the engine's, then sampled)
    stop_token_ids: list[int]  # masked while below min_tokens: EOS (even if ignored) + stop ids
    generator: torch.Generator | None  # seeded, non-greedy requests only
    resumed: bool  # re-added after preemption (prompt logprobs were already sent)
    # speculative decoding: the drafts the worker last proposed (latest only), and the
    # distribution each was drawn from ([n, V], draft model) or None (certain drafts)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    lora: LoRARequest | None = None  # the adapter it runs with (multi-LoRA)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def has_penalties(self) -> bool:
        p = self.sampling_params
        no_penalty = (0.0, 0.0, 1.0)
        return (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) != no_penalty


class RequestStore:
    """Every request on the worker, by id; at most ``max_num_reqs``, each on its own row."""

    def __init__(
        self, *, max_num_reqs: int, vocab_size: int, device: torch.device | str = "cpu"
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.version = 0  # bumped by every add and remove
        self._states: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self._parked_generators: dict[str, torch.Generator] = {}  # of preempted requests

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def __getitem__(self, req_id: str) -> CachedRequestState:
        return self._states[req_id]

    def get(self, req_id: str) -> CachedRequestState | None:
        return self._states.get(req_id)

    def add(
        self,
        req_id: str,
        sampling_params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int] = (),
        eos_token_ids: Sequence[int] = (),
        *,
        resumed: bool = False,
        lora: LoRARequest | None = None,
    ) -> CachedRequestState:
        """Register a request (new, or resumed after preemption with its outputs so far) on a
        free row; one already here is replaced."""
        if req_id in self._states:
            self.remove(req_id)
        if not self._free_rows:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} requests)")
        # EOS is masked below min_tokens whatever ignore_eos says (vLLM's MinTokens rule), so
        # min_tokens=max_tokens with ignore_eos is transformers' min_new_tokens.
        stop_ids = [*eos_token_ids, *(sampling_params.stop_token_ids or [])]
        state = CachedRequestState(
            req_id=req_id,
            row=self._free_rows.pop(),
            sampling_params=sampling_params,
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(output_token_ids),
            stop_token_ids=[t for t in dict.fromkeys(stop_ids) if t < self.vocab_size],
            generator=self._generator_for(req_id, sampling_params),
            resumed=resumed,
            lora=lora,
        )
        self._states[req_id] = state
        self.version += 1
        return state

    def remove(self, req_id: str, *, preempted: bool = False) -> CachedRequestState | None:
        """Forget a request and free its row. A preempted one's generator waits for its return."""
        state = self._states.pop(req_id, None)
        self._parked_generators.pop(req_id, None)
        if state is None:
            return None
        if preempted and state.generator is not None:
            self._parked_generators[req_id] = state.generator
        self._free_rows.append(state.row)
        self.version += 1
        return state

    def clear(self) -> None:
        for req_id in list(self._states):
            self.remove(req_id)
        self._parked_generators.clear()

    def _generator_for(self, req_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.is_greedy:
            return None
        parked = self._parked_generators.pop(req_id, None)
        if parked is not None:
            return parked
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed)
        return generator
