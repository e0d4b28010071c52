"""What a chat request's tools and tool_choice mean (``gateway.tools.tool_plan``), as vLLM
decides it: the default choice, the server's flags for ``auto``, the grammar of ``required``
and named calls, and each mistake a 400 naming the field."""

from __future__ import annotations

import msgspec
import pytest

from shoal.gateway.errors import ApiError
from shoal.gateway.request_types import ChatCompletionRequest
from shoal.gateway.tool_parsers import HERMES
from shoal.gateway.tools import ToolCallingOptions, tool_plan

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ON = ToolCallingOptions(True, "hermes")


def _body(**fields: object) -> ChatCompletionRequest:
    raw = msgspec.json.encode({"messages": [{"role": "user", "content": "x"}], **fields})
    return msgspec.json.decode(raw, type=ChatCompletionRequest)


def test_plans() -> None:
    assert tool_plan(_body(), ON) is None
    assert tool_plan(_body(tools=[TOOL], tool_choice="none"), ToolCallingOptions()) is None
    auto = tool_plan(_body(tools=[TOOL]), ON)  # auto by default when tools are given
    assert auto is not None and auto.mode == "auto" and auto.fmt is HERMES
    assert auto.constraint is None and auto.skip_special_tokens is False
    required = tool_plan(_body(tools=[TOOL], tool_choice="required"), ToolCallingOptions())
    assert required is not None and required.constraint is not None
    schema = required.constraint.json
    assert isinstance(schema, dict) and schema["minItems"] == 1 and "maxItems" not in schema
    assert required.constraint.disable_any_whitespace
    one = tool_plan(_body(tools=[TOOL], tool_choice="required", parallel_tool_calls=False), ON)
    assert one is not None and isinstance(one.constraint.json, dict)  # type: ignore[union-attr]
    assert one.constraint.json["maxItems"] == 1  # type: ignore[union-attr,index]
    named = tool_plan(_body(tools=[TOOL], tool_choice={"function": {"name": "f"}}), ON)
    assert named is not None and named.name == "f" and named.constraint is not None
    assert named.constraint.json == {"type": "object"}
    assert named.finish_reason(True, "stop") == "stop"
    assert required.finish_reason(True, "stop") == "tool_calls"
    assert required.finish_reason(True, "length") == "length"
    assert auto.finish_reason(True, "length") == "tool_calls"
    assert auto.finish_reason(False, "stop") == "stop"


@pytest.mark.parametrize(
    ("fields", "options"),
    [
        ({"tools": [TOOL]}, ToolCallingOptions(False, "hermes")),  # auto without the flag
        ({"tools": [TOOL], "tool_choice": "auto"}, ToolCallingOptions()),
        ({"tool_choice": "required"}, ON),  # no tools
        ({"tools": [TOOL], "tool_choice": "always"}, ON),
        ({"tools": [TOOL], "tool_choice": {"function": {"name": "g"}}}, ON),
        ({"tools": [TOOL], "tool_choice": "required", "guided_regex": "a"}, ON),
    ],
)
def test_mistakes_name_tool_choice(fields: dict[str, object], options: ToolCallingOptions) -> None:
    with pytest.raises(ApiError) as caught:
        tool_plan(_body(**fields), options)
    assert caught.value.status == 400 and caught.value.param == "tool_choice"
