"""Requests a step fails alone (a non-fatal ``StepError``): a new request whose own inputs the
model cannot take, checked before it joins the persistent batch: a token id outside the
vocabulary (the embedding lookup would fail the whole batch's forward, and on CUDA poison the
device; in ``logit_bias`` or ``allowed_token_ids`` the sampler could not apply it) or more tokens
than ``max_model_len``. The runner leaves such a request out of the batch,
runs the others and names it in ``StepError(fatal=False)``. It stays rejected until the engine
core lists it as finished or preempted: a later step sent before this one's result came back
(async scheduling) may still schedule it, and fails it alone again.

Everything else that goes wrong in a step is fatal: the worker cannot tell that it is confined
to some requests (see ``workers.actor``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shoal.bus.messages.sampling import out_of_vocab
from shoal.bus.messages.worker import NewRequestData, StepError

MAX_REMEMBERED = 4096  # rejected ids kept while waiting for the engine core to finish them


def reject_reason(new: NewRequestData, vocab_size: int, max_model_len: int) -> str | None:
    """Why ``new``'s own inputs cannot run, or None."""
    num_tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
    if num_tokens > max_model_len:
        return f"{num_tokens} tokens exceed max_model_len={max_model_len}"
    for what, ids in (("prompt", new.prompt_token_ids), ("output", new.output_token_ids)):
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):  # one C pass each, not a list
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            return f"{what} token id {bad} is out of range (vocabulary size {vocab_size})"
    if invalid := out_of_vocab(new.sampling_params, vocab_size):
        return invalid[1]
    return None


class Rejections:
    """The requests this worker refused, with why, until the engine core lets them go."""

    def __init__(self, vocab_size: int, max_model_len: int) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._reasons: dict[str, str] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._reasons

    def admit(self, new: NewRequestData) -> bool:
        """True if ``new`` may join the batch; else it is remembered as rejected."""
        reason = reject_reason(new, self.vocab_size, self.max_model_len)
        if reason is None:
            self._reasons.pop(new.req_id, None)
            return True
        self.refuse(new.req_id, reason)
        return False

    def refuse(self, req_id: str, reason: str) -> None:
        """Remember ``req_id`` as rejected for ``reason`` (an input the runner found bad
        later, such as an adapter that cannot be read)."""
        if len(self._reasons) >= MAX_REMEMBERED:
            del self._reasons[next(iter(self._reasons))]
        self._reasons[req_id] = reason

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._reasons.pop(req_id, None)

    def clear(self) -> None:
        self._reasons.clear()

    def error(self, step_id: int, req_ids: Sequence[str]) -> StepError | None:
        """The non-fatal error of step ``step_id`` for its rejected ``req_ids`` (None if none)."""
        if not self._reasons:  # every step asks: nothing to scan in the usual case
            return None
        rejected = [r for r in req_ids if r in self._reasons]
        if not rejected:
            return None
        why = "; ".join(f"request {r}: {self._reasons[r]}" for r in rejected)
        return StepError(f"step {step_id} refused requests: {why}", rejected, fatal=False)
