"""JSON generated under a schema never holds what JSON forbids (issue 35, item 5): a string
with ``minLength``/``maxLength``, which xgrammar 0.2.8 let take raw control characters (a forced
tool call's arguments then failed strict parsing and the call was lost), is written as a
``pattern`` of as many non-control characters, so the grammar refuses every character
U+0000-U+001F there while keeping the bounds; other schemas are left as they are."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr

from shoal.bus.messages.structured import StructuredOutputsParams
from shoal.engine.structured.grammars import compile_grammar, json_safe_schema
from shoal.gateway.tool_parsers.forced import required_schema

CONTROL = [chr(c) for c in range(0x20)]


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    """A compiler over a vocabulary of every ASCII character (strings are fed as text)."""
    info = xgr.TokenizerInfo([chr(i) for i in range(128)])
    return xgr.GrammarCompiler(info)


def accepts(compiler: xgr.GrammarCompiler, schema: dict[str, Any], text: str) -> bool:
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    matcher = xgr.GrammarMatcher(compile_grammar(compiler, params))
    return bool(matcher.accept_string(text))


def obj(prop: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"x": prop}, "required": ["x"]}


@pytest.mark.parametrize(
    "prop",
    [
        {"type": "string", "minLength": 1},
        {"type": "string", "maxLength": 8},
        {"type": "string", "minLength": 1, "maxLength": 8},
        {"type": "string"},
        {"type": "string", "pattern": "^.*$"},
        {},
    ],
)
def test_no_control_character_enters_a_string(compiler, prop) -> None:  # type: ignore[no-untyped-def]
    schema = obj(prop)
    assert accepts(compiler, schema, '{"x": "ab"}')
    for char in CONTROL:
        assert not accepts(compiler, schema, '{"x": "a' + char), repr(char)


def test_the_bounds_still_hold(compiler) -> None:  # type: ignore[no-untyped-def]
    schema = obj({"type": "string", "minLength": 2, "maxLength": 3})
    assert accepts(compiler, schema, '{"x": "ab"}') and accepts(compiler, schema, '{"x": "abc"}')
    assert not accepts(compiler, schema, '{"x": "a"}')
    assert not accepts(compiler, schema, '{"x": "abcd')


def test_a_forced_calls_arguments_refuse_control_characters(compiler) -> None:  # type: ignore[no-untyped-def]
    """``tool_choice: "required"``'s grammar around a tool whose argument is bounded."""
    city = {"type": "string", "minLength": 1, "maxLength": 40}
    schema = required_schema([("get_weather", obj(city))])
    prefix = '[{"name": "get_weather", "parameters": {"x": "Pa'
    assert accepts(compiler, schema, prefix + 'ris"}}]')
    assert not any(accepts(compiler, schema, prefix + char) for char in CONTROL)


def test_only_length_bounded_strings_are_rewritten() -> None:
    untouched = [
        {"type": "string", "maxLength": 3, "enum": ["a"]},
        {"type": "string", "minLength": 1, "pattern": "^[a-z]+$"},
        {"type": "string", "maxLength": 9, "format": "date"},
        {"type": "array", "minItems": 1},
        {"type": "object", "properties": {"minLength": {"type": "integer"}}},
    ]
    for schema in untouched:
        assert json_safe_schema(schema) == schema
    nested = {"type": "array", "items": {"anyOf": [{"type": "string", "maxLength": 4}]}}
    assert json.dumps(json_safe_schema(nested)) == json.dumps(
        {
            "type": "array",
            "items": {"anyOf": [{"type": "string", "pattern": r"^[^\x00-\x1f]{0,4}$"}]},
        }
    )


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_constraint_after_reasoning_lets_the_thinking_be(compiler, parser) -> None:  # type: ignore[no-untyped-def]
    """With a reasoning parser the grammar holds after ``</think>`` (vLLM's default): any
    thinking first (deepseek_r1: the prompt opened it; qwen3: optional), then the schema."""
    schema = obj({"type": "integer"})

    def ok(text: str) -> bool:
        params = StructuredOutputsParams(
            json=schema, disable_any_whitespace=True, after_reasoning=parser
        )
        return bool(xgr.GrammarMatcher(compile_grammar(compiler, params)).accept_string(text))

    opened = "" if parser == "deepseek_r1" else "<think>"
    assert ok(opened + 'any <words> at all</think>{"x": 3}')
    assert not ok(opened + 'thinking</think>{"x": "no"}')  # after it: the schema
    # no thinking written: qwen3's schema holds from the start; deepseek_r1 is still thinking
    assert ok('{"x": "no"}') == (parser == "deepseek_r1")
