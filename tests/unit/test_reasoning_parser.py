"""The reasoning parsers (``gateway.reasoning``): a whole output split as vLLM's deepseek_r1 and
qwen3 parsers split it, and, for any output cut into any deltas, the streamed reasoning and
content joining to exactly the whole split (a tag cut between deltas is held back)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.gateway.reasoning import (
    ReasoningSplit,
    ReasoningStream,
    count_reasoning_tokens,
    split_reasoning,
)


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        ("deepseek_r1", "<think>plan</think>answer", "plan", "answer"),
        ("deepseek_r1", "plan</think>answer", "plan", "answer"),  # the prompt opened it
        ("deepseek_r1", "still thinking", "still thinking", None),
        ("deepseek_r1", "</think>answer", "", "answer"),
        ("qwen3", "<think>plan</think>answer", "plan", "answer"),
        ("qwen3", "\n<think>plan</think>", "plan", None),
        ("qwen3", "plain answer", None, "plain answer"),  # enable_thinking off
        ("qwen3", "a </think> in an answer", None, "a </think> in an answer"),
        ("qwen3", "<think>cut short", "cut short", None),
    ],
)
def test_a_whole_output_is_split(parser, text, reasoning, content) -> None:  # type: ignore[no-untyped-def]
    assert split_reasoning(parser, text) == ReasoningSplit(reasoning, content)


PIECES = st.lists(
    st.sampled_from(
        ["<think>", "</think>", "<", "</", "</th", "ink>", "think", "a", " ", "\n", "é"]
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(parser=st.sampled_from(["deepseek_r1", "qwen3"]), pieces=PIECES, data=st.data())
def test_streamed_deltas_join_to_the_whole_split(parser, pieces, data) -> None:  # type: ignore[no-untyped-def]
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *cuts, len(text)]
    deltas = [text[a:b] for a, b in pairwise(bounds)]
    stream = ReasoningStream(parser)
    reasoning = content = ""
    for i, delta in enumerate(deltas):
        r, c = stream.feed(delta, final=i == len(deltas) - 1)
        reasoning, content = reasoning + r, content + c
    whole = split_reasoning(parser, text)
    assert reasoning == (whole.reasoning or "") and content == (whole.content or "")


@pytest.mark.parametrize("in_reasoning", [False, True])
def test_a_chat_grammar_holds_after_the_thinking_unless_asked_otherwise(in_reasoning) -> None:  # type: ignore[no-untyped-def]
    from shoal.gateway.chat import prepare_chat
    from shoal.gateway.metrics import Metrics
    from shoal.gateway.request_types import ChatCompletionRequest, ChatMessage
    from shoal.gateway.serving import ServingContext
    from tests.unit.test_gateway_fake import FakeEngineClient

    ctx = ServingContext(
        FakeEngineClient(), "m", Metrics("m", max_model_len=256),
        reasoning_parser="qwen3", structured_in_reasoning=in_reasoning,
    )  # fmt: skip
    body = ChatCompletionRequest(
        messages=[ChatMessage("user", "hi")], structured_outputs={"json": {"type": "object"}}
    )
    constraint = prepare_chat(ctx, body).params.structured_outputs
    assert constraint is not None
    assert constraint.after_reasoning == (None if in_reasoning else "qwen3")


def _chars(text: str) -> tuple[list[int], Callable[[list[int]], str]]:
    """``text`` as one token per character, and its decoder."""
    return [ord(c) for c in text], lambda ids: "".join(chr(i) for i in ids)


@pytest.mark.parametrize(
    ("parser", "text", "expected"),
    [
        ("deepseek_r1", "abc</think>answer", len("abc</think>")),
        ("deepseek_r1", "still thinking", len("still thinking")),
        ("qwen3", "<think>hm</think>ok", len("<think>hm</think>")),
        ("qwen3", "no thinking", 0),
        ("deepseek_r1", "</think>at once", len("</think>")),
    ],
)
def test_reasoning_tokens_are_those_through_the_closing_tag(
    parser: str, text: str, expected: int
) -> None:
    ids, decode = _chars(text)
    assert count_reasoning_tokens(parser, ids, decode) == expected
