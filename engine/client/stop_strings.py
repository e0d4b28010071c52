"""Stop strings, as vLLM's frontend handles them (the engine core never sees them).

- The search covers only newly added text (plus the ``len(stop) - 1`` characters before it, for a
  stop string that straddles the boundary), and not text from the first ``min_tokens`` tokens.
- The earliest-completing stop string wins; ties go to the order of the list.
- The stop string is cut from the text unless ``include_stop_str_in_output``.
- Streamed text holds back ``max(len(s)) - 1`` characters (when the stop string is excluded) so a
  partial match is never emitted; everything is released when the request finishes.
"""

from __future__ import annotations

from collections.abc import Sequence


def check_stop_strings(
    output_text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find the stop string completed by the last ``new_char_count`` characters.

    Returns ``(stop_string, truncate_to)`` or None; ``truncate_to`` is the length to cut the text
    to, or -1 when nothing needs cutting (the stop string, included, ends the text).
    """
    if new_char_count <= 0 or not stop:
        return None
    best: tuple[str, int, int] | None = None  # (stop string, start, end)
    for stop_str in stop:
        # A match must end inside the new text, so it starts at most len(stop_str)-1 before it.
        search_from = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        start = output_text.find(stop_str, search_from)
        if start == -1:
            continue
        end = start + len(stop_str)
        if best is None or end < best[2]:
            best = (stop_str, start, end)
    if best is None:
        return None
    stop_str, start, end = best
    if not include_in_output:
        return stop_str, start
    return stop_str, (-1 if end == len(output_text) else end)


class StopStringMatcher:
    """One completion's text: accumulates it, finds stop strings, releases it with hold-back."""

    def __init__(
        self, stop: Sequence[str] | None, include_in_output: bool = False, min_tokens: int = 0
    ) -> None:
        self.stop: list[str] = list(stop or [])
        self.include_in_output = include_in_output
        self.min_tokens = min_tokens
        self.hold_back = (
            max(len(s) for s in self.stop) - 1 if self.stop and not include_in_output else 0
        )
        self.text = ""
        self.matched: str | None = None
        self._num_released = 0  # characters already handed out as deltas

    def append(self, new_text: str, num_output_tokens: int) -> str | None:
        """Add the text of output token number ``num_output_tokens`` (1-based).

        Returns the stop string it completes (and cuts the text accordingly), or None. Text of
        the first ``min_tokens`` tokens is never searched.
        """
        if self.matched is not None:
            raise RuntimeError("text appended after a stop string matched")
        self.text += new_text
        if not self.stop or num_output_tokens <= self.min_tokens:
            return None
        found = check_stop_strings(self.text, len(new_text), self.stop, self.include_in_output)
        if found is None:
            return None
        self.matched, truncate_to = found
        if truncate_to != -1:
            self.text = self.text[:truncate_to]
        return self.matched

    def visible_text(self, finished: bool) -> str:
        """All text that may be shown now (the held-back tail excluded until finished)."""
        if finished or self.hold_back == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold_back)]

    def next_delta(self, finished: bool) -> str:
        """The visible text not yet handed out; advances the release point."""
        visible_len = len(self.visible_text(finished))
        if visible_len <= self._num_released:
            return ""
        delta = self.text[self._num_released : visible_len]
        self._num_released = visible_len
        return delta
