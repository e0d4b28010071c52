"""The traces of ``bench/routing.py`` and the best hit rate a trace allows.

A shared-prefix trace: ``groups`` system prompts, each shared by ``convs`` conversations of
``turns`` turns; a turn's prompt is the conversation so far (the previous prompt, its answer)
plus a new user message. Requests are sent in waves (everything of one wave at once, the next
wave when it has finished); conversation 0 of each group starts one wave before the others, as
a first user does, so its system prompt can be cached before they arrive. A unique trace:
the same number of requests and prompt lengths, no prefix shared with anything.

The ideal (``hit_rate_max``): one engine core with an unbounded prefix cache that sees every
request, counted as the engine counts (full blocks only, never the prompt's last token): a
request hits the leading blocks of its prompt that any request of an earlier wave computed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

FIRST_TOKEN = 3  # ids 0-2 are pad, bos, eos


@dataclass(frozen=True)
class TraceShape:
    groups: int
    convs: int
    turns: int
    system_len: int
    user_len: int
    max_tokens: int


@dataclass
class Conversation:
    """One conversation's tokens so far; ``prompt`` is its next request."""

    start_wave: int
    system: list[int]
    users: list[list[int]]
    history: list[int] = field(default_factory=list)

    def prompt(self, turn: int) -> list[int]:
        return (self.history or self.system) + self.users[turn]

    def answered(self, prompt: list[int], output: list[int]) -> None:
        self.history = prompt + output


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)]


def shared_trace(shape: TraceShape, seed: int, vocab: int) -> list[Conversation]:
    rng = random.Random(seed)
    conversations = []
    for _ in range(shape.groups):
        system = random_tokens(rng, shape.system_len, vocab)
        for c in range(shape.convs):
            users = [random_tokens(rng, shape.user_len, vocab) for _ in range(shape.turns)]
            conversations.append(Conversation(0 if c == 0 else 1, system, users))
    return conversations


def unique_trace(shape: TraceShape, seed: int, vocab: int) -> list[Conversation]:
    """Single-turn conversations of the shared trace's first prompt length, nothing shared."""
    rng = random.Random(seed)
    num = shape.groups * shape.convs * shape.turns
    length = shape.system_len + shape.user_len
    return [
        Conversation(i // (shape.groups * shape.convs), random_tokens(rng, length, vocab), [[]])
        for i in range(num)
    ]


def wave_requests(conversations: list[Conversation], wave: int) -> list[tuple[int, int]]:
    """(conversation index, turn) of every request of ``wave``."""
    return [
        (i, wave - conv.start_wave)
        for i, conv in enumerate(conversations)
        if 0 <= wave - conv.start_wave < len(conv.users)
    ]


def num_waves(conversations: list[Conversation]) -> int:
    return max(conv.start_wave + len(conv.users) for conv in conversations)


class IdealCache:
    """Chained keys of every full block some earlier wave computed."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.keys: set[bytes] = set()
        self._pending: list[list[int]] = []

    def _chain(self, tokens: list[int]) -> Iterable[bytes]:
        parent = b""
        size = self.block_size
        for first in range(0, len(tokens) - size + 1, size):
            block = ",".join(map(str, tokens[first : first + size])).encode()
            parent = hashlib.sha256(parent + block).digest()
            yield parent

    def hit_tokens(self, prompt: list[int]) -> int:
        max_blocks = (len(prompt) - 1) // self.block_size
        hits = 0
        for key in self._chain(prompt):
            if hits == max_blocks or key not in self.keys:
                break
            hits += 1
        return hits * self.block_size

    def computed(self, prompt: list[int], output: list[int]) -> None:
        """A request of this wave ran: its blocks count from the next wave on (the last output
        token's KV is never computed)."""
        self._pending.append(prompt + output[:-1])

    def next_wave(self) -> None:
        for tokens in self._pending:
            self.keys.update(self._chain(tokens))
        self._pending.clear()
