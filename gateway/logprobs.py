"""Engine log-probabilities (one ``{token_id: Logprob}`` per position) in OpenAI's two shapes:
completions' parallel lists and chat's list of token entries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shoal.engine.client.outputs import Logprob, TokenLogprobs
from shoal.gateway.response_types import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)

MIN_LOGPROB = -9999.0  # what -inf becomes (JSON has no infinities)


def clamp(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB  # also maps NaN to the floor


class TokenText:
    """Decodes single token ids for logprob entries, preferring the engine's decoded text."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def _ranked(position: TokenLogprobs, count: int) -> list[tuple[int, Logprob]]:
    """The ``count`` most likely entries of one position, most likely first."""
    if count <= 0:
        return []
    entries = sorted(position.items(), key=lambda item: -item[1].logprob)
    return entries[:count]


def append_completion_logprobs(
    target: CompletionLogprobs,
    token_ids: Sequence[int],
    positions: Sequence[TokenLogprobs | None],
    num_top: int,
    token_text: TokenText,
    text_offset: int,
) -> int:
    """Append tokens to completions-shaped logprobs; returns the text offset after them.

    A position of None (the first prompt token under echo) has no logprob.
    """
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id) if position else None
        text = token_text(token_id, chosen)
        target.tokens.append(text)
        target.text_offset.append(text_offset)
        text_offset += len(text)
        if position is None:
            target.token_logprobs.append(None)
            target.top_logprobs.append(None)
            continue
        target.token_logprobs.append(clamp(chosen.logprob) if chosen else MIN_LOGPROB)
        # Tokens may share a text (partial UTF-8 decodes to "\ufffd"): keep the likelier.
        top: dict[str, float] = {}
        for tid, lp in _ranked(position, num_top):
            top.setdefault(token_text(tid, lp), clamp(lp.logprob))
        if chosen is not None:
            top.setdefault(text, clamp(chosen.logprob))
        target.top_logprobs.append(top)
    return text_offset


def chat_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[TokenLogprobs | None],
    num_top: int,
    token_text: TokenText,
) -> ChatLogprobs:
    """Chat-shaped logprobs for generated tokens: each with its ``num_top`` alternatives."""
    content: list[ChatTokenLogprob] = []
    for token_id, position in zip(token_ids, positions, strict=False):
        position = position or {}
        chosen = position.get(token_id)
        text = token_text(token_id, chosen)
        top = [
            TopLogprob(t, clamp(lp.logprob), list(t.encode()))
            for t, lp in ((token_text(tid, lp), lp) for tid, lp in _ranked(position, num_top))
        ]
        logprob = clamp(chosen.logprob) if chosen else MIN_LOGPROB
        content.append(ChatTokenLogprob(text, logprob, list(text.encode()), top))
    return ChatLogprobs(content)
