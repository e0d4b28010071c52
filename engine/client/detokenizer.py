"""Incremental detokenization of one request's output tokens.

``decode_next(token_id)`` returns the text that token completes. A character whose UTF-8 bytes
span several tokens is held until its last byte arrives, so streamed text never carries a
replacement character for a split character; ``flush()`` at the end releases whatever is still
held (bytes that never completed a character decode as U+FFFD, exactly as a full decode does).
The concatenation of every ``decode_next`` result and ``flush()`` equals the full decode of the
output tokens.

Two strategies: ``FastIncrementalDetokenizer`` drives the Rust ``tokenizers.decoders.DecodeStream``
of a fast tokenizer; ``OffsetIncrementalDetokenizer`` is the prefix/read-offset method that works
with any tokenizer's ``decode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenizers.decoders import DecodeStream

from shoal.engine.client.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# The prompt tokens kept as decoding context (enough for a split character or a leading space).
_MIN_PROMPT_CONTEXT = 4
_MAX_PROMPT_CONTEXT = 24


class IncrementalDetokenizer(Protocol):
    def decode_next(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


def make_detokenizer(
    tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
) -> IncrementalDetokenizer:
    """The fast (DecodeStream) detokenizer when the tokenizer has a Rust backend, else offsets."""
    context = prompt_context(tokenizer, prompt_token_ids)
    if tokenizer.backend is not None:
        return FastIncrementalDetokenizer(tokenizer, context, skip_special_tokens)
    return OffsetIncrementalDetokenizer(tokenizer, context, skip_special_tokens)


def prompt_context(tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> list[int]:
    """The shortest prompt suffix (a few tokens) that decodes cleanly, or [] if there is none.

    Context only shapes how the first output token decodes (e.g. a leading space); a suffix with
    broken bytes would leak its replacement characters into the output, so it is dropped.
    """
    ids = list(prompt_token_ids)
    shortest = min(len(ids), _MIN_PROMPT_CONTEXT)
    for length in range(shortest, min(len(ids), _MAX_PROMPT_CONTEXT) + 1):
        suffix = ids[-length:] if length else []
        if REPLACEMENT_CHAR not in tokenizer.decode(suffix, skip_special_tokens=False):
            return suffix
    return []


class FastIncrementalDetokenizer:
    """``DecodeStream`` per request, primed with the prompt context."""

    def __init__(
        self, tokenizer: Tokenizer, context_ids: list[int], skip_special_tokens: bool
    ) -> None:
        backend = tokenizer.backend
        if backend is None:
            raise ValueError("FastIncrementalDetokenizer needs a fast (Rust-backed) tokenizer")
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending_ids: list[int] = []  # tokens fed since the last emitted chunk
        for token_id in context_ids:  # prime the stream; the prompt's own text is not output
            self.decode_next(token_id)
        self._pending_ids.clear()

    def decode_next(self, token_id: int) -> str:
        self._pending_ids.append(token_id)
        try:
            chunk = self._stream.step(self._backend, token_id)
        except Exception:
            # An id the stream cannot continue from (e.g. an invalid prefix): restart it bare.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            try:
                chunk = self._stream.step(self._backend, token_id)
            except Exception:
                chunk = None
        if chunk is None:
            return ""
        self._pending_ids.clear()
        return str(chunk)

    def flush(self) -> str:
        if not self._pending_ids:
            return ""
        text = self._backend.decode(
            self._pending_ids, skip_special_tokens=self._skip_special_tokens
        )
        self._pending_ids.clear()
        return str(text)


class OffsetIncrementalDetokenizer:
    """The prefix/read-offset method: decode a short window, emit what grew past the prefix."""

    def __init__(
        self, tokenizer: Tokenizer, context_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(context_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _window_texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip)
        new_text = decode(self._ids[self._prefix_offset :], skip)
        return prefix_text, new_text

    def decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still split across tokens
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text, new_text = self._window_texts()
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
