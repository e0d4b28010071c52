"""The parsing every tool-call format shares, described by a ``CallFormat`` (the tag that opens
the calls, the text around and between the call objects, the key of the arguments):
``ToolCallStream`` turns text deltas into content and tool-call deltas; ``extract_calls`` parses
a whole text with it and keeps the calls only if every one is complete with object arguments
(else the whole text is content, as vLLM answers a malformed call). Content before the calls
stays content; text after the last call is dropped."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from shoal.gateway.tool_parsers.calls import (
    DeltaToolCall,
    ExtractedToolCalls,
    StreamDelta,
    arguments_delta,
    join_deltas,
    new_tool_call_id,
    opening_delta,
)
from shoal.gateway.tool_parsers.json_scan import CallObjectScanner, ScanEvents

BLANK = ""  # in a frame pattern: any run of whitespace, possibly empty
Pattern = tuple[str, ...]
FULL, PARTIAL, FAIL = "full", "partial", "fail"
CONTENT, FRAME, OBJECT, DONE = range(4)


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a model family writes its calls: ``start_tag`` opens them (None: the text is
    calls from its first character); ``bare_json_start``: a ``{`` as the first non-blank
    character opens them too; ``opening``: the text from the tag to the first ``{``;
    ``between``: from one call's closing ``}`` to the next ``{``; ``argument_keys``: where
    a call object keeps its arguments; ``skip_special_tokens``: what the request must use
    so the tags survive detokenizing (None: as asked)."""

    start_tag: str | None
    opening: Pattern
    between: Pattern
    argument_keys: tuple[str, ...] = ("arguments",)
    bare_json_start: bool = False
    skip_special_tokens: bool | None = None


def frame_match(pattern: Pattern, text: str) -> str:
    """Whether ``text`` is the whole of ``pattern`` (FULL), could still become it (PARTIAL),
    or cannot (FAIL). Literals never start with whitespace, so blanks match greedily."""
    pos = 0
    for item in pattern:
        if item == BLANK:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            continue
        rest = text[pos:]
        if rest.startswith(item):
            pos += len(item)
        elif item.startswith(rest):
            return PARTIAL
        else:
            return FAIL
    return FULL if pos == len(text) else FAIL


@dataclass(slots=True)
class _Call:
    index: int
    buffered: list[str] = field(default_factory=list)  # arguments seen before the name
    opened: bool = False
    complete: bool = False


class ToolCallStream:
    """Streaming extraction for one choice: ``feed`` each text delta, ``finish`` at the end.
    Calls are numbered from 0 in order; the first delta of each carries its id and name."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self.state = CONTENT if fmt.start_tag is not None else FRAME
        self.pattern = fmt.opening
        self.frame = ""
        self.pending = ""  # content held back: it may be the start of the tag
        self.held: list[str] = []  # the raw text after the content, until a call is named
        self.at_start = True
        self.calls: list[_Call] = []
        self.scanner: CallObjectScanner | None = None

    @property
    def called(self) -> bool:
        """Whether any call was named (the choice's finish reason is then ``tool_calls``)."""
        return any(call.opened for call in self.calls)

    @property
    def all_complete(self) -> bool:
        return all(call.complete for call in self.calls)

    def feed(self, text: str) -> StreamDelta:
        delta = StreamDelta()
        i = 0
        while i < len(text):
            before, state = i, self.state
            if state == CONTENT:
                i = self._content(text, i, delta)
            elif state == FRAME:
                i = self._frame(text, i)
            elif state == OBJECT:
                i = self._object(text, i, delta)
            else:
                i = len(text)
            if state != CONTENT and not self.called:
                self.held.append(text[before:i])
        return delta

    def finish(self) -> StreamDelta:
        """The content still held back: the partial tag, or all the text after the content
        when no call was named in it."""
        delta = StreamDelta(self.pending)
        self.pending = ""
        if self.state != CONTENT and not self.called:
            delta.content += "".join(self.held)
        self.held.clear()
        return delta

    def _content(self, text: str, i: int, delta: StreamDelta) -> int:
        char = text[i]
        if self.at_start and self.fmt.bare_json_start:
            if char.isspace():
                self.pending += char
                return i + 1
            if char == "{":
                self.held, self.pending = [self.pending], ""
                self._begin_object()
                return i
        self.at_start = False
        tag = self.fmt.start_tag or ""
        pending = self.pending + char
        if pending.endswith(tag):
            delta.content += pending[: -len(tag)]
            self.held, self.pending = [tag], ""
            self.state, self.pattern, self.frame = FRAME, self.fmt.opening, ""
            return i + 1
        keep = next(k for k in range(min(len(tag) - 1, len(pending)), -1, -1)
                    if pending.endswith(tag[:k]))  # fmt: skip
        delta.content += pending[: len(pending) - keep]
        self.pending = pending[len(pending) - keep :]
        return i + 1

    def _frame(self, text: str, i: int) -> int:
        char = text[i]
        if char == "{" and frame_match(self.pattern, self.frame) == FULL:
            self._begin_object()
            return i
        self.frame += char
        if frame_match(self.pattern, self.frame) == FAIL:
            self.state = DONE
        return i + 1

    def _begin_object(self) -> None:
        self.state = OBJECT
        self.scanner = CallObjectScanner(self.fmt.argument_keys)
        self.calls.append(_Call(len(self.calls)))

    def _object(self, text: str, i: int, delta: StreamDelta) -> int:
        scanner = self.scanner
        assert scanner is not None
        used, events = scanner.feed(text[i:])
        call = self.calls[-1]
        self._emit(call, events, delta.tool_calls)
        if scanner.done and call.opened:
            if not scanner.has_arguments:
                delta.tool_calls.append(arguments_delta(call.index, "{}"))
            call.complete = True
            self.state, self.pattern, self.frame = FRAME, self.fmt.between, ""
        elif scanner.done or scanner.failed:
            self.state = DONE
        return i + used

    def _emit(self, call: _Call, events: ScanEvents, out: list[DeltaToolCall]) -> None:
        if events.name is not None and not call.opened:
            call.opened = True
            out.append(opening_delta(call.index, events.name, new_tool_call_id()))
            if call.buffered:
                out.append(arguments_delta(call.index, "".join(call.buffered)))
                call.buffered.clear()
        if not events.arguments:
            return
        if call.opened:
            out.append(arguments_delta(call.index, events.arguments))
        else:
            call.buffered.append(events.arguments)


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def extract_calls(fmt: CallFormat, text: str) -> ExtractedToolCalls:
    """The calls in a whole text; the whole text as content unless every call it starts is
    complete, named and has object arguments."""
    stream = ToolCallStream(fmt)
    delta = stream.feed(text)
    delta.extend(stream.finish())
    calls = join_deltas(delta.tool_calls)
    complete = stream.called and stream.all_complete
    if not complete or not all(is_json_object(c.function.arguments) for c in calls):
        return ExtractedToolCalls(text)
    return ExtractedToolCalls(delta.content or None, calls)
