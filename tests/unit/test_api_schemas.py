"""The schema check the API tests rely on fails where it must: an undeclared field (at any
depth), a missing required field, a value of the wrong type."""

from __future__ import annotations

import pytest
from anthropic.types import Message
from pydantic import ValidationError

from tests.fixtures.api_schemas import check_schema, sse_events

MESSAGE = {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
    "content": [{"type": "text", "text": "hi"}],
    "stop_reason": "end_turn", "stop_sequence": None,
    "usage": {"input_tokens": 3, "output_tokens": 1},
}  # fmt: skip


def test_a_valid_body_passes() -> None:
    assert check_schema(Message, MESSAGE).content[0].text == "hi"


def test_an_undeclared_field_fails_at_any_depth() -> None:
    with pytest.raises(AssertionError, match=r"\$\.store"):
        check_schema(Message, {**MESSAGE, "store": True})
    nested = {**MESSAGE, "content": [{"type": "text", "text": "hi", "extra": 1}]}
    with pytest.raises(AssertionError, match=r"\$\.content\[0\]\.extra"):
        check_schema(Message, nested)


def test_a_missing_or_mistyped_field_fails() -> None:
    with pytest.raises(ValidationError):
        check_schema(Message, {k: v for k, v in MESSAGE.items() if k != "usage"})
    with pytest.raises(ValidationError):
        check_schema(Message, {**MESSAGE, "usage": {"input_tokens": "many", "output_tokens": 1}})


def test_sse_events_reads_data_lines() -> None:
    text = 'event: a\ndata: {"x": 1}\n\n: keep-alive\n\ndata: [DONE]\n\n'
    assert sse_events(text) == [{"x": 1}]
