"""An incremental scanner of one JSON object that names a function call
(``{"name": ..., "arguments": {...}}``): fed text piece by piece, it reports the name once its
string has closed and passes the arguments value's characters on as they arrive, verbatim (so
streamed fragments join to exactly the text a whole-text parse takes). It checks structure
only as far as it needs to find keys and values; callers that need validity parse the result."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WS = " \t\r\n"
# Top-level phases inside the object.
KEY_WAIT, IN_KEY, COLON_WAIT, VALUE_WAIT, IN_VALUE, AFTER_VALUE, DONE, FAILED = range(8)


@dataclass(slots=True)
class ScanEvents:
    """What a piece of text revealed: the name (once), argument characters, the end."""

    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class CallObjectScanner:
    """Scans one object from its opening ``{``; ``argument_keys``: the keys whose value is
    the arguments (the first one present wins)."""

    argument_keys: tuple[str, ...]
    phase: int = -1  # before the opening brace
    key_chars: list[str] = field(default_factory=list)
    key: str = ""
    value_chars: list[str] = field(default_factory=list)  # the name's or a scalar's text
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    scalar: bool = False
    has_arguments: bool = False
    has_name: bool = False
    is_arguments: bool = False  # this value is the arguments
    streaming: bool = False  # ... and is passed on as it comes (not a scalar)

    @property
    def done(self) -> bool:
        return self.phase == DONE

    @property
    def failed(self) -> bool:
        return self.phase == FAILED

    def feed(self, text: str) -> tuple[int, ScanEvents]:
        """Scan ``text``; returns how many characters belonged to the object (all of them
        unless it ended, or failed, on the way) and what they revealed."""
        events = ScanEvents()
        out: list[str] = []
        for i, char in enumerate(text):
            if self.phase in (DONE, FAILED):
                events.arguments = "".join(out)
                return i, events
            self._step(char, events, out)
        events.arguments = "".join(out)
        return len(text), events

    def _step(self, char: str, events: ScanEvents, out: list[str]) -> None:
        phase = self.phase
        if phase == IN_VALUE:
            self._value_char(char, events, out)
        elif phase == -1:
            self.phase = KEY_WAIT if char == "{" else FAILED
        elif phase == IN_KEY:
            self._key_char(char)
        elif char in WS:
            return
        elif phase in (KEY_WAIT, AFTER_VALUE):
            self._between(char)
        elif phase == COLON_WAIT:
            self.phase = VALUE_WAIT if char == ":" else FAILED
        elif phase == VALUE_WAIT:
            self._start_value(char, events, out)

    def _between(self, char: str) -> None:
        if char == "}":
            self.phase = DONE
        elif char == "," and self.phase == AFTER_VALUE:
            self.phase = KEY_WAIT
        elif char == '"' and self.phase == KEY_WAIT:
            self.phase, self.key_chars, self.escaped = IN_KEY, [], False
        else:
            self.phase = FAILED

    def _key_char(self, char: str) -> None:
        if char == '"' and not self.escaped:
            try:
                self.key = json.loads('"' + "".join(self.key_chars) + '"')
            except ValueError:
                self.phase = FAILED
                return
            self.phase = COLON_WAIT
            return
        self.escaped = char == "\\" and not self.escaped
        self.key_chars.append(char)

    def _start_value(self, char: str, events: ScanEvents, out: list[str]) -> None:
        self.phase = IN_VALUE
        self.value_chars = []
        self.depth, self.in_string, self.escaped = 0, False, False
        self.scalar = char not in '{["'
        self.is_arguments = self.key in self.argument_keys and not self.has_arguments
        self.has_arguments = self.has_arguments or self.is_arguments
        self.streaming = self.is_arguments and not self.scalar
        self._value_char(char, events, out)

    def _value_char(self, char: str, events: ScanEvents, out: list[str]) -> None:
        if self.scalar:
            if char in WS or char in ",}":
                self._end_value(events, out)
                if char not in WS:
                    self._between(char)
                return
            self.value_chars.append(char)
            return
        self._keep(char, out)
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                if self.depth == 0:
                    self._end_value(events, out)
            return
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._end_value(events, out)

    def _keep(self, char: str, out: list[str]) -> None:
        if self.streaming:
            out.append(char)
        else:
            self.value_chars.append(char)

    def _end_value(self, events: ScanEvents, out: list[str]) -> None:
        self.phase = AFTER_VALUE
        text = "".join(self.value_chars)
        if self.key == "name" and not self.has_name:
            self.has_name = True
            try:
                name = json.loads(text)
            except ValueError:
                name = None
            if isinstance(name, str):
                events.name = name
        elif self.is_arguments and self.scalar:
            out.append(text)
        self.is_arguments = self.streaming = False
