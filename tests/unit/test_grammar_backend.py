"""The engine core's xgrammar backend (``engine/structured/backend.py``) on a tiny byte-level
tokenizer, and the worker's mask (``workers/grammar_mask.py``): a grammar compiles off the
caller's thread and its matcher's bitmask allows exactly the tokens that keep the output in the
language; tokens advance it, a refused one is refused; a resumed request's output is replayed; a
bad grammar fails with xgrammar's reason; the worker's mask sets ``-inf`` on exactly the clear
bits of the listed rows and nothing else."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from shoal.bus.messages.structured import GrammarBitmask, StructuredOutputsParams
from shoal.engine.core.grammar import GrammarState
from shoal.engine.structured.backend import XgrammarBackend
from shoal.engine.structured.grammars import GrammarError, check_grammar
from shoal.workers.grammar_mask import allowed_tokens, apply_grammar_bitmask, apply_packed
from tests.fixtures.models import build_tokenizer

EOS = 0


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


def _ready(backend: XgrammarBackend, request_id: str) -> GrammarState:
    deadline = time.monotonic() + 60
    while (state := backend.state(request_id)[0]) is GrammarState.COMPILING:
        assert time.monotonic() < deadline, "the grammar never compiled"
        time.sleep(0.01)
    return state


def _vocab(tokenizer_dir: Path) -> tuple[XgrammarBackend, list[str]]:
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    size = len(tokenizer)
    texts = [tokenizer.decode([t]) for t in range(size)]
    return XgrammarBackend(str(tokenizer_dir), size + 5, [EOS]), texts


def test_the_bitmask_allows_exactly_the_tokens_that_stay_in_the_language(
    tokenizer_dir: Path,
) -> None:
    backend, texts = _vocab(tokenizer_dir)
    backend.start("r", StructuredOutputsParams(regex="ab[0-9]"), [])
    assert _ready(backend, "r") is GrammarState.READY
    allowed = allowed_tokens(backend.bitmask(["r"], {}), backend.vocab_size)[0]
    expected = {t for t, text in enumerate(texts) if text and re.fullmatch(r"a|ab|ab[0-9]", text)}
    assert set(torch.nonzero(allowed).flatten().tolist()) == expected
    assert not allowed[len(texts) :].any()  # the model's padded vocabulary: never
    a = texts.index("a")
    assert backend.accept("r", [a])
    assert not backend.accept("r", [a])  # "aa" leaves the language; the matcher stays
    assert backend.accept("r", [texts.index("b"), texts.index("7")])
    done = allowed_tokens(backend.bitmask(["r"], {}), backend.vocab_size)[0]
    assert torch.nonzero(done).flatten().tolist() == [EOS]  # complete: only the stop token
    backend.release("r")
    assert backend.state("r")[0] is GrammarState.FAILED  # forgotten


def test_drafts_are_tried_and_rolled_back_with_a_row_per_position(tokenizer_dir: Path) -> None:
    backend, texts = _vocab(tokenizer_dir)
    backend.start("r", StructuredOutputsParams(regex="ab[0-9]"), [])
    assert _ready(backend, "r") is GrammarState.READY
    a, b, seven = texts.index("a"), texts.index("b"), texts.index("7")
    assert backend.valid_prefix("r", [a, b, a, seven]) == 2  # "aba" leaves the language
    assert backend.valid_prefix("r", [b]) == 0  # the matcher did not move: "b" still refused
    bitmask = backend.bitmask(["r"], {"r": [a, b]})
    assert bitmask.req_ids == ["r", "r", "r"]
    rows = allowed_tokens(bitmask, backend.vocab_size)
    assert rows[0, a] and not rows[0, b]  # at the start
    assert rows[1, b] and not rows[1, a]  # after "a"
    assert rows[2, seven] and not rows[2, b]  # after "ab"
    assert torch.equal(allowed_tokens(backend.bitmask(["r"], {}), backend.vocab_size)[0], rows[0])
    logits = torch.zeros(4, backend.vocab_size)
    apply_grammar_bitmask(logits, {"r": 1}, bitmask)  # the request's rows start at row 1
    assert torch.equal(logits[0], torch.zeros(backend.vocab_size))
    for k in range(3):
        assert torch.equal(logits[1 + k] == 0, rows[k])


def test_a_resumed_request_replays_its_output_and_a_bad_one_fails(tokenizer_dir: Path) -> None:
    backend, texts = _vocab(tokenizer_dir)
    choice = StructuredOutputsParams(choice=["yes", "no"])
    backend.start("ok", choice, [texts.index("y")])
    backend.start("bad", choice, [texts.index("x")])
    assert _ready(backend, "ok") is GrammarState.READY
    allowed = allowed_tokens(backend.bitmask(["ok"], {}), backend.vocab_size)[0]
    assert {texts[t] for t in torch.nonzero(allowed).flatten().tolist()} <= {"e", "es"}
    assert _ready(backend, "bad") is GrammarState.FAILED
    assert "does not match its grammar" in backend.state("bad")[1]


def test_a_bad_grammar_fails_to_compile_with_the_reason(tokenizer_dir: Path) -> None:
    backend, _ = _vocab(tokenizer_dir)
    backend.start("r", StructuredOutputsParams(grammar="root ::= undefined_rule"), [])
    assert _ready(backend, "r") is GrammarState.FAILED
    assert 'Rule "undefined_rule" is not defined' in backend.state("r")[1]


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        (StructuredOutputsParams(json={"type": "objectx"}), 'Unsupported type "objectx"'),
        (StructuredOutputsParams(json="{not json"), "is not valid JSON"),
        (StructuredOutputsParams(regex="[a-"), "Unclosed '['"),
        (StructuredOutputsParams(grammar="root ::= x"), 'Rule "x" is not defined'),
    ],
)
def test_check_grammar_names_the_mistake(params: StructuredOutputsParams, reason: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(reason)):
        check_grammar(params)


def test_params_need_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="at least one string"):
        StructuredOutputsParams(choice=[])


def test_the_worker_masks_exactly_the_clear_bits_of_listed_rows() -> None:
    vocab = 40  # two words, the second partly past the vocabulary
    words = torch.randint(-(2**31), 2**31 - 1, (2, 2), dtype=torch.int64).to(torch.int32)
    bitmask = GrammarBitmask(["b", "gone"], 2, words.numpy().astype("<i4").tobytes())
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_grammar_bitmask(logits, {"a": 0, "b": 2}, bitmask)  # "gone" samples in no row
    assert torch.equal(logits[:2], before[:2])  # rows not listed: untouched
    bits = [(int(words[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    for t in range(vocab):
        assert (logits[2, t] == float("-inf")) == (bits[t] == 0), t
        if bits[t]:
            assert logits[2, t] == before[2, t]
    apply_grammar_bitmask(logits, {"a": 0}, None)  # no bitmask: nothing
    assert torch.equal(logits[:2], before[:2])
    on_device = before.clone()  # the accelerator's path, run here: the same result
    apply_packed(on_device, torch.tensor([2]), words.numpy()[:1])
    assert torch.equal(on_device, logits)
