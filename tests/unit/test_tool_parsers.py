"""The tool-call parsers (Hermes/Qwen, Llama 3 JSON, Mistral, and ``required``'s array): for
hypothesis-generated calls (names, nested argument objects with awkward strings) written in each
format with varied spacing, the whole-text parse finds the content before the calls and every
call with its arguments; the same text streamed in random pieces gives the same content, and
argument fragments that join to the same arguments, each call opened once with an id and name."""

from __future__ import annotations

import itertools
import json
import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.gateway.tool_parsers import TOOL_CALL_FORMATS, hermes, llama3_json, mistral
from shoal.gateway.tool_parsers.calls import StreamDelta, join_deltas
from shoal.gateway.tool_parsers.forced import (
    REQUIRED,
    NamedCallStream,
    extract_named,
    required_schema,
)
from shoal.gateway.tool_parsers.stream import (
    CallFormat,
    ToolCallStream,
    extract_calls,
    frame_match,
)

NAMES = st.text(string.ascii_letters + "_", min_size=1, max_size=8)
PIECES = [*'ab {}[]",:;\\é\n', "<tool_call>", "[TOOL_CALLS]"]
AWKWARD = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)
SCALARS = st.one_of(st.integers(-1000, 1000), st.booleans(), st.none(), AWKWARD)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
ARGUMENTS = st.dictionaries(st.text(string.ascii_lowercase, max_size=5), VALUES, max_size=4)
CALLS = st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3)
CONTENT = st.text(string.ascii_letters + " .,!?\n", max_size=20)
SPACE = st.sampled_from(["", " ", "\n", " \n "])


def _dumps(draw: st.DrawFn, value: Any) -> str:
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
    indent = draw(st.sampled_from([None, 2]))
    return json.dumps(value, separators=separators, indent=indent, ensure_ascii=draw(st.booleans()))


@st.composite
def written(draw: st.DrawFn, fmt: str) -> tuple[str, str, list[tuple[str, dict[str, Any]]]]:
    """(content, text, calls): calls in ``fmt`` after the content."""
    calls = draw(CALLS)
    content = draw(CONTENT)
    key = {"llama3_json": "parameters", "required": "parameters"}.get(fmt, "arguments")
    objects = []
    for name, arguments in calls:
        pairs = [("name", name), (key, arguments)]
        if draw(st.booleans()):
            pairs.reverse()  # arguments before the name: held until the name is known
        objects.append(_dumps(draw, dict(pairs)))
    s = [draw(SPACE) for _ in range(4)]
    if fmt == "hermes":
        body = "".join(f"<tool_call>{s[0]}{o}{s[1]}</tool_call>{s[2]}" for o in objects)
    elif fmt == "llama3_json":
        body = "<|python_tag|>" + s[0] + f"{s[1]};{s[2]}".join(objects)
        if not content.strip() and draw(st.booleans()):
            content, body = "", s[3] + f"{s[1]};{s[2]}".join(objects)
    elif fmt == "mistral":
        body = "[TOOL_CALLS]" + s[0] + "[" + s[1] + f"{s[2]},".join(objects) + s[3] + "]"
    else:
        content, body = "", s[0] + "[" + ",".join(objects) + "]"
    return content, content + body, calls


FORMATS = {**TOOL_CALL_FORMATS, "required": REQUIRED}


def _split(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def _stream(fmt: CallFormat, pieces: list[str]) -> tuple[StreamDelta, ToolCallStream]:
    stream = ToolCallStream(fmt)
    out = StreamDelta()
    for piece in pieces:
        out.extend(stream.feed(piece))
    out.extend(stream.finish())
    return out, stream


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_whole_and_streamed_parses_agree(fmt: str, data: st.DataObject) -> None:
    content, text, calls = data.draw(written(fmt))
    whole = extract_calls(FORMATS[fmt], text)
    assert whole.content == (content or None)
    assert [c.function.name for c in whole.tool_calls] == [name for name, _ in calls]
    assert [json.loads(c.function.arguments) for c in whole.tool_calls] == [a for _, a in calls]
    assert len({c.id for c in whole.tool_calls}) == len(calls)
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in whole.tool_calls)

    streamed, stream = _stream(FORMATS[fmt], _split(data.draw, text))
    assert stream.called
    assert streamed.content == content
    joined = join_deltas(streamed.tool_calls)
    assert [(c.function.name, c.function.arguments) for c in joined] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls
    ]
    openers = [d for d in streamed.tool_calls if d.id is not None]
    assert [d.index for d in openers] == list(range(len(calls)))
    assert all(d.type == "function" and d.function and d.function.name for d in openers)
    for index in range(len(calls)):  # the opener comes before any argument fragment
        first = next(d for d in streamed.tool_calls if d.index == index)
        assert first.id is not None


@pytest.mark.parametrize("fmt", sorted(TOOL_CALL_FORMATS))
@settings(max_examples=100, deadline=None)
@given(
    text=st.lists(st.sampled_from([*'ab <>|_[]{}\n"', "<tool", "[TOOL"])).map("".join),
    data=st.data(),
)
def test_text_without_a_complete_call_is_all_content(
    fmt: str, text: str, data: st.DataObject
) -> None:
    whole = extract_calls(TOOL_CALL_FORMATS[fmt], text)
    if not whole.called:
        assert whole.content == text
    streamed, stream = _stream(TOOL_CALL_FORMATS[fmt], _split(data.draw, text))
    if not stream.called:
        assert streamed.content == text and not streamed.tool_calls


def test_each_format_by_example() -> None:
    h = hermes.extract('Let me.\n<tool_call>\n{"name": "f", "arguments": {"x": "}"}}\n</tool_call>')
    assert h.content == "Let me.\n" and h.tool_calls[0].function.arguments == '{"x": "}"}'
    unclosed = hermes.extract('<tool_call>{"name": "f", "arguments": {}}')
    assert unclosed.content is None and unclosed.tool_calls[0].function.name == "f"
    llama = llama3_json.extract('{"name": "g", "parameters": {"a": 1}}; {"name": "h"}')
    assert [(c.function.name, c.function.arguments) for c in llama.tool_calls] == [
        ("g", '{"a": 1}'),
        ("h", "{}"),
    ]
    also = llama3_json.extract('{"name": "g", "arguments": {"b": 2}}')
    assert also.tool_calls[0].function.arguments == '{"b": 2}'
    m = mistral.extract('ok [TOOL_CALLS] [{"name": "f", "arguments": {"c": [1]}}]')
    assert m.content == "ok " and m.tool_calls[0].function.arguments == '{"c": [1]}'


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut short
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # a name that is not a string
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f" "arguments": {}}</tool_call>',  # no comma
        "<tool_call>not json</tool_call>",
    ],
)
def test_a_malformed_call_leaves_the_whole_text_as_content(text: str) -> None:
    parsed = hermes.extract(text)
    assert parsed.content == text and not parsed.called


def test_text_after_the_calls_is_dropped_and_a_later_bad_call_voids_all() -> None:
    good = '{"name": "f", "parameters": {}}'
    assert llama3_json.extract(good + " and then some").tool_calls[0].function.name == "f"
    assert not llama3_json.extract(good + '; {"name": "g", "parameters": {').called
    assert not llama3_json.extract("I think " + good).called  # a bare call must lead


def test_frame_match() -> None:
    pattern = ("", "</tool_call>", "", "<tool_call>", "")
    assert frame_match(pattern, " </tool_call>\n<tool_call> ") == "full"
    assert frame_match(pattern, " </tool") == "partial"
    assert frame_match(pattern, " </tool_call>x") == "fail"


def test_required_schema_and_named_calls() -> None:
    schema = required_schema([("f", {"type": "object"}), ("g", None)])
    assert schema["minItems"] == 1
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"]["enum"] for b in branches] == [["f"], ["g"]]
    assert branches[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    named = extract_named("f", '{"a":1}')
    assert named.content is None and named.tool_calls[0].function.arguments == '{"a":1}'
    stream = NamedCallStream("f")
    deltas = [*stream.feed('{"a"').tool_calls, *stream.feed(":1}").tool_calls]
    deltas += stream.finish().tool_calls
    joined = join_deltas(deltas)
    assert [(c.function.name, c.function.arguments) for c in joined] == [("f", '{"a":1}')]
