"""The demo model builder: a loadable HF checkpoint, built once, published atomically."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from shoal.engine.client.tokenizer import MissingChatTemplateError, Tokenizer
from shoal.workers.demo import DemoSpec, ensure_demo_model
from shoal.workers.demo import build as demo_build
from shoal.workers.demo.corpus import iter_docstrings, zen_of_python

TINY = DemoSpec(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
    seq_len=16,
    batch_size=2,
    train_steps=2,
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("cache"), spec=TINY, num_threads=1)


def test_corpus_is_prose_from_the_stdlib() -> None:
    docs = list(iter_docstrings(("textwrap",)))
    assert any(d.qualname == "textwrap.dedent" for d in docs)
    assert "Beautiful is better than ugly." in zen_of_python()


def test_checkpoint_loads_with_transformers_and_generates(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in tiny_model.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert not list(tiny_model.parent.glob(".*build-*"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    assert model.config.model_type == "llama"
    assert model.config.num_hidden_layers == 1
    ids = hf_tokenizer("Return the", return_tensors="pt").input_ids
    assert ids[0, 0].item() == hf_tokenizer.bos_token_id
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)


def test_engine_tokenizer_reads_eos_and_chat_template(tiny_model: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(tiny_model)
    assert tokenizer.eos_token_ids == [tokenizer.hf.eos_token_id]
    messages = [{"role": "user", "content": "What does textwrap.dedent do?"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == "<s><|user|>\nWhat does textwrap.dedent do?</s>\n<|assistant|>\n"
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == tokenizer.hf.bos_token_id and ids.count(tokenizer.hf.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_missing_chat_template_is_a_clear_error(tiny_model: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(tiny_model)
    tokenizer.hf.chat_template = None
    with pytest.raises(MissingChatTemplateError, match="must provide a chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(tmp_path / "absent")


def test_second_call_reuses_the_cache(tiny_model: Path) -> None:
    messages: list[str] = []
    again = ensure_demo_model(tiny_model.parent, spec=TINY, log=messages.append)
    assert again == tiny_model and messages == []


def test_build_is_deterministic(tiny_model: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    other = ensure_demo_model(tmp_path, spec=TINY, num_threads=1, log=lambda _: None)
    first, second = (
        load_file(tiny_model / "model.safetensors"),
        load_file(other / "model.safetensors"),
    )
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert (tiny_model / "tokenizer.json").read_text() == (other / "tokenizer.json").read_text()


def test_a_failed_build_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(out_dir: Path, spec: DemoSpec, log: object) -> float:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr("shoal.workers.demo.train.build_demo_checkpoint", explode)
    with pytest.raises(RuntimeError, match="mid-build"):
        ensure_demo_model(tmp_path, spec=TINY, log=lambda _: None)
    assert [p.name for p in tmp_path.iterdir()] == [f".{demo_build.demo_dir_name(TINY)}.lock"]


def fake_build(out_dir: Path, spec: DemoSpec, log: object) -> float:
    (out_dir / "config.json").write_text("{}")
    return 0.0


def test_leftovers_of_a_crashed_build_are_cleared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("shoal.workers.demo.train.build_demo_checkpoint", fake_build)
    name = demo_build.demo_dir_name(TINY)
    (tmp_path / f".{name}.build-crashed").mkdir()
    (tmp_path / name).mkdir()  # a final directory without its manifest
    path = ensure_demo_model(tmp_path, spec=TINY, log=lambda _: None)
    assert demo_build.is_complete(path)
    assert not (tmp_path / f".{name}.build-crashed").exists()


def test_concurrent_callers_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[Path] = []

    def counting_build(out_dir: Path, spec: DemoSpec, log: object) -> float:
        builds.append(out_dir)
        return fake_build(out_dir, spec, log)

    monkeypatch.setattr("shoal.workers.demo.train.build_demo_checkpoint", counting_build)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_demo_model(tmp_path, spec=TINY)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(builds) == 1 and len(set(results)) == 1 and len(results) == 3


def test_default_spec_has_a_stable_name() -> None:
    assert demo_build.demo_dir_name(DemoSpec()) == f"demo-v{demo_build.DEMO_VERSION}"
    assert demo_build.demo_dir_name(TINY) != demo_build.demo_dir_name(DemoSpec())
