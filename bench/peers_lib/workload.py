"""The workload every engine gets: chat prompts built from a seed with the model's chat template
(a user question of random words, sized to a drawn number of tokens) and turned into token ids
here, once, so that every engine sees the very same ids; and the number of random words that
makes bench/serve.py's prompts about the serving stage's prompt length in this tokenizer."""

from __future__ import annotations

import random
import statistics
from typing import Any

_TEXT = (
    "river mountain city ship star garden clock bridge island forest letter song map lamp door "
    "window road bird fish cloud rain snow wind fire stone glass paper silver green red blue old "
    "new early late bright quiet music engine market teacher doctor village winter summer "
    "number history language kitchen question animal planet ocean desert machine children "
    "story travel money weather energy light water bread market coffee table"
)
WORDS = _TEXT.split(" ")
OPENINGS = (
    "Why do",
    "How can",
    "What makes",
    "Explain how",
    "Tell me why",
    "Describe what happens when",
    "Is it true that",
    "Compare",
)
FIT_STEPS = 8


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as one user turn in the chat template, ready for the assistant's answer."""
    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def sized_prompt(tokenizer: Any, rng: random.Random, target: int) -> list[int]:
    """A question of random words whose templated length comes closest to ``target``."""
    opening = rng.choice(OPENINGS)
    words = [rng.choice(WORDS) for _ in range(2 * target)]

    def ids(count: int) -> list[int]:
        return chat_ids(tokenizer, f"{opening} {' '.join(words[:count])}?")

    count = target // 2
    best = ids(count)
    for _ in range(FIT_STEPS):
        if len(best) == target:
            break
        count = max(1, min(len(words), count + target - len(best)))
        candidate = ids(count)
        if abs(len(candidate) - target) >= abs(len(best) - target):
            break
        best = candidate
    return best


def chat_prompts(tokenizer: Any, num: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    """``num`` prompts of ``lo``..``hi`` tokens (lengths drawn uniformly), the same per seed."""
    rng = random.Random(seed)
    return [sized_prompt(tokenizer, rng, rng.randint(lo, hi)) for _ in range(num)]


def serve_prompt_words(tokenizer: Any, target: int, seed: int) -> tuple[int, float]:
    """bench/serve.py's ``--prompt-words`` for prompts of about ``target`` tokens (as the
    completions endpoint tokenizes them), and the mean length it gives over 16 prompts."""
    from bench import serve

    words, mean = target, float(target)
    for _ in range(3):
        args = serve.parse_args(["--prompt-words", str(words), "--seed", str(seed)])
        mean = statistics.mean(len(tokenizer.encode(serve.make_prompt(i, args))) for i in range(16))
        if round(mean) == target:
            break
        words = max(1, round(words * target / mean))
    return words, mean
