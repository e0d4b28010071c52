"""Structured outputs in the worker: a step's ``GrammarBitmask`` (from the engine core, which
advances each request's grammar) applied to the logits before sampling: a token whose bit is
clear gets ``-inf``. Rows of requests the bitmask does not list are not touched, and a step
without one costs nothing.

On the CPU the bits become an additive bias (0 or ``-inf``, by table lookup) added to the listed
rows in one ``index_add_``: a boolean select (``masked_fill``, ``where``) is several times
slower there per element. On an accelerator the packed words go over and are unpacked and
applied there (the bias would be 32x the bytes)."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import torch

from shoal.bus.messages.structured import GrammarBitmask

_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)  # a clear bit, a set bit


def _words(bitmask: GrammarBitmask) -> np.ndarray:
    return np.frombuffer(bitmask.data, dtype="<i4").reshape(len(bitmask.req_ids), bitmask.words)


def _bits(bitmask: GrammarBitmask, vocab_size: int) -> np.ndarray:
    """``[rows, vocab_size]`` uint8, 1 where the token is allowed (none past the grammar's
    vocabulary)."""
    bits = np.unpackbits(_words(bitmask).view(np.uint8), axis=1, bitorder="little")
    if bits.shape[1] < vocab_size:
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    return bits[:, :vocab_size]


def allowed_tokens(bitmask: GrammarBitmask, vocab_size: int) -> torch.Tensor:
    """``[len(req_ids), vocab_size]`` bool: which tokens each listed row may sample."""
    return torch.from_numpy(_bits(bitmask, vocab_size)).bool()


def apply_grammar_bitmask(
    logits: torch.Tensor, row_of: Mapping[str, int], bitmask: GrammarBitmask | None
) -> None:
    """In place: the logits rows of each request the bitmask lists (``row_of``: request id →
    its first row in ``logits``; its ``k``-th bitmask row masks row ``first + k``, a verified
    draft's position) keep only their allowed tokens. Listed requests not in ``row_of`` (not
    sampling in this batch) are skipped."""
    if bitmask is None:
        return
    picked: list[int] = []
    targets: list[int] = []
    seen: dict[str, int] = {}
    for i, request_id in enumerate(bitmask.req_ids):
        if request_id in row_of:
            offset = seen[request_id] = seen.get(request_id, -1) + 1
            picked.append(i)
            targets.append(row_of[request_id] + offset)
    if not picked:
        return
    rows = torch.tensor(targets, device=logits.device)
    if logits.device.type == "cpu":
        bias = torch.from_numpy(_BIAS[_bits(bitmask, logits.shape[-1])[picked]])
        logits.index_add_(0, rows, bias.to(logits.dtype))
    else:
        apply_packed(logits, rows, _words(bitmask)[picked])


def apply_packed(logits: torch.Tensor, rows: torch.Tensor, words: np.ndarray) -> None:
    """The accelerator's way: ``words`` (packed rows) unpacked on ``logits``' device, then
    one ``masked_fill`` of those ``rows``."""
    vocab_size = logits.shape[-1]
    packed = torch.from_numpy(words.astype(np.int32)).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(len(words), -1).bool()
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab_size], float("-inf"))


class GrammarMailbox:
    """Late masks (``StepGrammar``) by step id, put by the worker's loop as they arrive and
    taken by the runner thread, which waits for its step's (a mask may also come before its
    step). Masks of steps older than the one taken are dropped."""

    def __init__(self) -> None:
        self._masks: dict[int, GrammarBitmask | None] = {}
        self._changed = threading.Condition()

    def put(self, step_id: int, bitmask: GrammarBitmask | None) -> None:
        with self._changed:
            self._masks[step_id] = bitmask
            self._changed.notify_all()

    def take(self, step_id: int, timeout_s: float) -> GrammarBitmask | None:
        """Step ``step_id``'s masks; ``TimeoutError`` if they do not come within
        ``timeout_s``."""
        with self._changed:
            if not self._changed.wait_for(lambda: step_id in self._masks, timeout_s):
                raise TimeoutError(f"no grammar masks for step {step_id} within {timeout_s} s")
            for old in [s for s in self._masks if s < step_id]:
                del self._masks[old]
            return self._masks.pop(step_id)
