"""``--tokenizer`` (vLLM's; ``LLM(tokenizer=...)``): another tokenizer serves a model, from a
Hugging Face directory or from a GGUF file's metadata; a missing one is refused at start."""

from __future__ import annotations

import pytest

from shoal import LLM, SamplingParams
from tests.fixtures.gguf_files import write_gguf
from tests.integration.served_stack import with_chat_template

pytestmark = pytest.mark.timeout(240)
CHAT = [[{"role": "user", "content": "the quick brown fox"}]]


def prompt_of(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    (out,) = llm.chat(CHAT, params, use_tqdm=False)
    return list(out.prompt_token_ids)


def chat_prompt(tokenizer_dir: str) -> list[int]:
    """transformers' rendering of ``CHAT`` with that tokenizer's template, tokenized."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = tokenizer.apply_chat_template(CHAT[0], add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_a_tokenizer_directory_or_gguf_file_serves_a_model(tiny_checkpoint, tmp_path, monkeypatch):
    from shoal.deploy.model_source import resolve_model

    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tiny_checkpoint("llama")
    bare, _ = write_gguf(model_dir, tmp_path / "bare.gguf", "Q8_0", chat_template=False)
    templated, _ = write_gguf(model_dir, tmp_path / "templated.gguf", "F32")
    tokenizer_dir = with_chat_template(model_dir, tmp_path / "tokenizer")
    with LLM(str(bare)) as llm, pytest.raises(ValueError, match="chat template"):
        prompt_of(llm)  # the file has no template of its own
    with LLM(str(bare), tokenizer=str(tokenizer_dir)) as llm:
        assert llm.config.model_config.tokenizer == str(tokenizer_dir)
        assert prompt_of(llm) == chat_prompt(str(tokenizer_dir))
    with LLM(str(bare), tokenizer=str(templated)) as llm:  # a GGUF file's tokenizer
        from_gguf = prompt_of(llm)
    assert from_gguf == chat_prompt(resolve_model(str(templated)).directory)
    assert from_gguf != chat_prompt(str(tokenizer_dir))  # the two templates differ


def test_a_missing_tokenizer_is_refused_at_start(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="tokenizer: model directory not found"):
        LLM(str(tiny_checkpoint("llama")), tokenizer=str(tmp_path / "absent"))
