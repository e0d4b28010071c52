"""Engine logprobs in OpenAI's completions and chat shapes."""

from __future__ import annotations

from shoal.engine.client.outputs import Logprob
from shoal.gateway.logprobs import (
    MIN_LOGPROB,
    TokenText,
    append_completion_logprobs,
    chat_logprobs,
    clamp,
)
from shoal.gateway.response_types import CompletionLogprobs
from tests.unit.test_gateway_fake import fake_tokenizer


def _position(chosen: int, *others: int) -> dict[int, Logprob]:
    entries = {chosen: Logprob(-2.0, 3, f"<{chosen}>")}
    for rank, token in enumerate(others, start=1):
        entries[token] = Logprob(-0.1 * rank, rank, f"<{token}>")
    return entries


def test_clamp() -> None:
    assert clamp(float("-inf")) == MIN_LOGPROB and clamp(float("nan")) == MIN_LOGPROB
    assert clamp(-1.5) == -1.5


def test_completion_shape_with_prompt_positions_and_offsets() -> None:
    target = CompletionLogprobs()
    text = TokenText(fake_tokenizer())
    offset = append_completion_logprobs(target, [7, 8], [None, _position(8, 9, 10)], 1, text, 0)
    assert target.tokens == [text(7), "<8>"]
    assert target.token_logprobs == [None, -2.0]
    assert target.top_logprobs == [None, {"<9>": -0.1, "<8>": -2.0}]  # top 1 plus the chosen
    assert target.text_offset == [0, len(text(7))]
    assert offset == len(text(7)) + 3


def test_chat_shape_lists_top_alternatives_most_likely_first() -> None:
    logprobs = chat_logprobs([8], [_position(8, 9, 10)], 2, TokenText(fake_tokenizer()))
    (entry,) = logprobs.content
    assert (entry.token, entry.logprob, entry.bytes) == ("<8>", -2.0, list(b"<8>"))
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [("<9>", -0.1), ("<10>", -0.2)]
    missing = chat_logprobs([8], [{}], 2, TokenText(fake_tokenizer()))
    assert missing.content[0].logprob == MIN_LOGPROB and missing.content[0].top_logprobs == []


def test_tokens_sharing_a_text_keep_the_likelier_logprob() -> None:
    """Byte-level tokens that are partial UTF-8 all decode to "\ufffd": the top entry for that
    text is the most likely of them, not the last one listed."""
    position = {
        7: Logprob(-3.0, 3, "\ufffd"),
        8: Logprob(-0.5, 1, "\ufffd"),
        9: Logprob(-1.0, 2, "a"),
    }
    target = CompletionLogprobs()
    append_completion_logprobs(target, [9], [position], 3, TokenText(fake_tokenizer()), 0)
    assert target.top_logprobs == [{"\ufffd": -0.5, "a": -1.0}]
