"""Incremental detokenization: streamed pieces join to the full decode, split characters wait."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shoal.engine.client.detokenizer import (
    FastIncrementalDetokenizer,
    OffsetIncrementalDetokenizer,
    make_detokenizer,
    prompt_context,
)
from shoal.engine.client.tokenizer import Tokenizer
from shoal.workers.demo.tokenizer import save_tokenizer

WORDS = ["hello", "world", "café", "naïve", "Ünïcödé", "façade", "über", "the", "and", "stop"]
CJK = ["你好", "世界", "中文", "日本語", "한국어", "模型"]
EMOJI = ["😀", "🚀", "👍🏽", "🇫🇷", "🧪"]
PIECES = WORDS + CJK + EMOJI + [" ", "  ", "\n", ", ", ".", "!"]
TRAIN_TEXT = [" ".join(WORDS * 3), " ".join(CJK[:3]), "hello world " * 5]

DETOKENIZERS = [FastIncrementalDetokenizer, OffsetIncrementalDetokenizer]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model_dir: Path = tmp_path_factory.mktemp("tok")
    save_tokenizer(TRAIN_TEXT, vocab_size=320, out_dir=model_dir)
    return Tokenizer.from_pretrained(model_dir)


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))


def stream(
    detok_cls: type, tokenizer: Tokenizer, prompt: list[int], ids: list[int], skip: bool
) -> list[str]:
    detok = detok_cls(tokenizer, prompt_context(tokenizer, prompt), skip)
    return [detok.decode_next(t) for t in ids] + [detok.flush()]


@pytest.mark.parametrize("detok_cls", DETOKENIZERS)
def test_streamed_text_joins_to_the_full_decode_without_replacement_chars(
    tokenizer: Tokenizer, detok_cls: type
) -> None:
    rng = random.Random(0)
    for _ in range(150):
        text = random_text(rng)
        prompt = tokenizer.encode(random_text(rng))
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = stream(detok_cls, tokenizer, prompt, ids, skip=True)
        assert "".join(pieces) == text == tokenizer.decode(ids)
        assert not any("\ufffd" in p for p in pieces), (text, pieces)


@pytest.mark.parametrize("detok_cls", DETOKENIZERS)
@pytest.mark.parametrize("skip", [True, False])
def test_random_token_ids_join_to_the_full_decode(
    tokenizer: Tokenizer, detok_cls: type, skip: bool
) -> None:
    """Arbitrary ids (invalid byte runs, special tokens) still reproduce decode() exactly."""
    rng = random.Random(1)
    for _ in range(150):
        ids = [rng.randrange(len(tokenizer.hf)) for _ in range(rng.randint(1, 10))]
        prompt = [rng.randrange(len(tokenizer.hf)) for _ in range(rng.randint(0, 6))]
        pieces = stream(detok_cls, tokenizer, prompt, ids, skip=skip)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip), ids


def split_character(tokenizer: Tokenizer) -> tuple[str, list[int]]:
    for char in EMOJI + list("".join(CJK)):
        ids = tokenizer.encode(char, add_special_tokens=False)
        if len(ids) > 1:
            return char, ids
    raise AssertionError("the test tokenizer splits no character across tokens")


@pytest.mark.parametrize("detok_cls", DETOKENIZERS)
def test_a_character_split_across_tokens_appears_only_when_complete(
    tokenizer: Tokenizer, detok_cls: type
) -> None:
    char, ids = split_character(tokenizer)
    pieces = stream(detok_cls, tokenizer, tokenizer.encode("hello"), ids + ids, skip=True)
    assert pieces[: len(ids) - 1] == [""] * (len(ids) - 1)
    assert pieces[len(ids) - 1] == char
    assert "".join(pieces) == char * 2


@pytest.mark.parametrize("detok_cls", DETOKENIZERS)
def test_an_unfinished_character_is_released_by_flush(
    tokenizer: Tokenizer, detok_cls: type
) -> None:
    _, ids = split_character(tokenizer)
    head = ids[:-1]
    pieces = stream(
        detok_cls, tokenizer, [], tokenizer.encode("hi", add_special_tokens=False) + head, True
    )
    assert "\ufffd" not in "".join(pieces[:-1])
    assert pieces[-1] == tokenizer.decode(head)  # the replacement chars of a full decode
    assert "\ufffd" in pieces[-1]


def test_special_tokens_are_skipped_or_shown(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_ids[0]
    ids = [*tokenizer.encode("hello", add_special_tokens=False), eos]
    for skip, expected in [(True, "hello"), (False, "hello</s>")]:
        detok = make_detokenizer(tokenizer, tokenizer.encode("world"), skip)
        assert "".join(detok.decode_next(t) for t in ids) + detok.flush() == expected


def test_leading_space_after_the_prompt_is_kept(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" world", add_special_tokens=False)
    detok = make_detokenizer(tokenizer, tokenizer.encode("hello"), True)
    assert "".join(detok.decode_next(t) for t in ids) == " world"


def test_prompt_context_is_a_short_clean_suffix(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("hello world " * 20)
    context = prompt_context(tokenizer, prompt)
    assert 4 <= len(context) < len(prompt)
    assert context == prompt[-len(context) :]
