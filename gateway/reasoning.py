"""Reasoning models' thinking, split from the answer (vLLM's ``--reasoning-parser``): the text
between ``<think>`` and ``</think>`` is ``reasoning_content``, the rest ``content`` (where tool
calls are then looked for). Two of vLLM's parsers:

- ``deepseek_r1``: the template opens ``<think>`` in the prompt, so the output starts inside
  the thinking (a ``<think>`` it writes itself is dropped): everything before ``</think>`` is
  reasoning, and an output that never closes it is reasoning only.
- ``qwen3``: thinking is optional (``chat_template_kwargs: {"enable_thinking": false}`` turns
  it off): an output that does not open with ``<think>`` is all content.

``ReasoningStream`` splits a streamed output delta by delta; a tag cut between deltas is held
back until it is whole, so the deltas join to exactly the split of the whole text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

START, END = "<think>", "</think>"
Decode = Callable[[list[int]], str]


def prompt_closes_thinking(prompt_tail: str) -> bool:
    """Whether a prompt (its last few tokens' text) ends with the thinking closed: the model
    answers at once (vLLM looks for the end of the reasoning in the prompt the same way)."""
    return prompt_tail.rstrip().endswith(END)


def count_reasoning_tokens(parser: str, token_ids: list[int], decode: Decode) -> int:
    """How many of an output's tokens are its thinking: through the one that completes
    ``</think>`` (found by bisection over decoded prefixes), all of them when the thinking never
    closes, none when there is no thinking."""
    text = decode(token_ids)
    if split_reasoning(parser, text).reasoning is None:
        return 0
    if END not in text:
        return len(token_ids)
    low, high = 1, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if END in decode(token_ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return low


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    reasoning: str | None
    content: str | None


def split_reasoning(parser: str, text: str) -> ReasoningSplit:
    """A whole output's reasoning and content."""
    stripped = text.lstrip()
    opened = stripped.startswith(START)
    if parser == "qwen3" and not opened:
        return ReasoningSplit(None, text or None)
    body = stripped[len(START) :] if opened else text
    reasoning, end, content = body.partition(END)
    if not end:
        return ReasoningSplit(body, None)
    return ReasoningSplit(reasoning, content or None)


class ReasoningStream:
    """``split_reasoning`` delta by delta: ``feed`` returns the new reasoning and content."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self._seen = ""  # everything fed so far
        self._reasoning_sent = 0  # characters of the split's reasoning already returned
        self._content_sent = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content ``delta`` adds (``final``: the output's last delta)."""
        self._seen += delta
        seen = self._seen
        if not final:
            head = seen.lstrip()
            if START.startswith(head):  # maybe the opening tag, not whole yet: wait
                return "", ""
            if END not in seen:  # a tag cut at the end stays back until it is whole
                seen = seen[: len(seen) - _held_back(seen)]
        split = split_reasoning(self.parser, seen)
        reasoning, content = split.reasoning or "", split.content or ""
        new = reasoning[self._reasoning_sent :], content[self._content_sent :]
        self._reasoning_sent, self._content_sent = len(reasoning), len(content)
        return new


def _held_back(text: str) -> int:
    """How many trailing characters may be the start of ``</think>``."""
    for size in range(min(len(END) - 1, len(text)), 0, -1):
        if text.endswith(END[:size]):
            return size
    return 0
