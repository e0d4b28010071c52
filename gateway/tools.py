"""Tool calling on ``/v1/chat/completions``, as vLLM does it: ``tools`` go to the chat template;
``tool_choice`` (default ``auto`` when tools are given, else ``none``) decides what happens to
the output. ``none``: plain content. ``auto``: the server's ``--tool-call-parser`` finds calls
in the text (a 400 without ``--enable-auto-tool-choice``). ``required`` and a named function:
the output is constrained to a JSON schema (``tool_parsers.forced``) and read straight into
calls. A ``ToolPlan`` holds the decision for one request; each choice gets its own parser."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from shoal.bus.messages.structured import StructuredOutputsParams
from shoal.gateway.errors import bad_request
from shoal.gateway.request_types import ChatCompletionRequest, NamedToolChoice
from shoal.gateway.structured import structured_outputs_of
from shoal.gateway.tool_parsers import TOOL_CALL_FORMATS
from shoal.gateway.tool_parsers.calls import ExtractedToolCalls, StreamDelta
from shoal.gateway.tool_parsers.forced import (
    REQUIRED,
    NamedCallStream,
    extract_named,
    parameters_schema,
    required_schema,
)
from shoal.gateway.tool_parsers.stream import CallFormat, ToolCallStream, extract_calls

CHOICES = ("none", "auto", "required")
TOOL_CALLS = "tool_calls"


@dataclass(frozen=True, slots=True)
class ToolCallingOptions:
    """The server's tool-calling flags (vLLM's ``--enable-auto-tool-choice`` and
    ``--tool-call-parser``)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


class CallStream(Protocol):
    @property
    def called(self) -> bool: ...

    def feed(self, text: str) -> StreamDelta: ...

    def finish(self) -> StreamDelta: ...


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one request's tools mean for its output: ``mode`` auto, required or named (a
    request whose output is plain text has no plan)."""

    mode: str
    fmt: CallFormat | None = None  # auto and required: how the calls are written
    name: str | None = None  # named: the function
    constraint: StructuredOutputsParams | None = None  # required and named

    def stream(self) -> CallStream:
        if self.name is not None:
            return NamedCallStream(self.name)
        assert self.fmt is not None
        return ToolCallStream(self.fmt)

    def extract(self, text: str) -> ExtractedToolCalls:
        if self.name is not None:
            return extract_named(self.name, text)
        assert self.fmt is not None
        return extract_calls(self.fmt, text)

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """vLLM's: ``tool_calls`` when auto found calls, or required's calls ended by the
        grammar (``stop``); a named call keeps the engine's reason, as OpenAI answers it."""
        if not called or reason is None:
            return reason
        if self.mode == "auto" or (self.mode == "required" and reason == "stop"):
            return TOOL_CALLS
        return reason

    @property
    def skip_special_tokens(self) -> bool | None:
        return self.fmt.skip_special_tokens if self.mode == "auto" and self.fmt else None


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template takes them (transformers' ``tools=``: OpenAI's dicts)."""
    if not body.tools:
        return None
    return [
        {"type": tool.type, "function": msgspec.to_builtins(tool.function)} for tool in body.tools
    ]


def tool_plan(body: ChatCompletionRequest, options: ToolCallingOptions) -> ToolPlan | None:
    """The request's plan (None: plain content); every mistake is a 400 naming the field."""
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if body.tools else "none"
    if isinstance(choice, str) and choice not in CHOICES:
        raise bad_request(
            f"tool_choice must be none, auto, required or a named function, got {choice!r}",
            param="tool_choice",
        )
    if choice == "none":
        return None
    if not body.tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "auto":
        return _auto_plan(options)
    if structured_outputs_of(body) is not None:
        raise bad_request(
            "tool_choice required or a named function constrains the output itself: drop "
            "response_format / structured_outputs",
            param="tool_choice",
        )
    if choice == "required":
        tools = [(t.function.name, t.function.parameters) for t in body.tools]
        schema = required_schema(tools, parallel=body.parallel_tool_calls is not False)
        return ToolPlan("required", REQUIRED, constraint=_json(schema))
    assert isinstance(choice, NamedToolChoice)
    return _named_plan(body, choice.function.name)


def _auto_plan(options: ToolCallingOptions) -> ToolPlan:
    parser = options.tool_call_parser
    if not options.enable_auto_tool_choice or parser is None:
        raise bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            "be set",
            param="tool_choice",
        )
    return ToolPlan("auto", TOOL_CALL_FORMATS[parser])


def _named_plan(body: ChatCompletionRequest, name: str) -> ToolPlan:
    tool = next((t for t in body.tools or [] if t.function.name == name), None)
    if tool is None:
        raise bad_request(
            f"The tool specified in `tool_choice` ({name!r}) does not match any of the "
            "specified `tools`",
            param="tool_choice",
        )
    schema = parameters_schema(tool.function.parameters)
    return ToolPlan("named", name=name, constraint=_json(schema))


def _json(schema: dict[str, Any]) -> StructuredOutputsParams:
    """The grammar of forced calls: compact JSON, so a weak model cannot stall in blanks."""
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
