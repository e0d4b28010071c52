"""Checkpoint loading: single and sharded safetensors, dtypes, tied embeddings, both expert
spellings, mmap'd zero-copy reads, progress bar, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shoal.workers.config import CheckpointConfigError
from shoal.workers.loader import CheckpointError, load_model, read_safetensors
from shoal.workers.models import UnsupportedArchitectureError
from tests.fixtures.models import build_checkpoint


def hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_every_shard(tmp_path):
    model_dir = build_checkpoint(
        "qwen2", tmp_path / "m", max_shard_size="100KB", with_tokenizer=False
    )
    assert (model_dir / "model.safetensors.index.json").exists()
    assert len(list(model_dir.glob("*.safetensors"))) > 2
    model, cfg = load_model(model_dir, dtype=torch.float32)
    ref = hf_state(model_dir)
    layer = model.model.layers[1]
    attn = layer.self_attn.qkv_proj
    q, k, v = (ref[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(attn.weight, torch.cat([q, k, v]))
    qb, kb, vb = (ref[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv")
    assert torch.equal(attn.bias, torch.cat([qb, kb, vb]))
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])
    assert cfg.attention_bias and cfg.architecture == "Qwen2ForCausalLM"


def test_tied_embeddings_share_the_embedding(tmp_path):
    model_dir = build_checkpoint("llama_tied", tmp_path / "m", with_tokenizer=False)
    model, cfg = load_model(model_dir, dtype=torch.float32)
    assert cfg.tie_word_embeddings
    hidden = torch.randn(3, cfg.hidden_size)
    expected = hidden @ model.model.embed_tokens.weight.t()
    assert torch.allclose(model.compute_logits(hidden), expected, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_checkpoint_loads_as_half(tmp_path, dtype):
    model_dir = build_checkpoint("llama", tmp_path / "m", with_tokenizer=False)
    model, _ = load_model(model_dir, dtype=dtype)
    ref = hf_state(model_dir)["model.layers.0.mlp.down_proj.weight"]
    got = model.model.layers[0].mlp.down_proj.weight
    assert got.dtype == dtype and torch.equal(got, ref.to(dtype))


def test_bf16_checkpoint_loads_as_fp32(tmp_path):
    model_dir = build_checkpoint("qwen3", tmp_path / "m", dtype="bfloat16", with_tokenizer=False)
    model, cfg = load_model(model_dir, dtype=torch.float32)
    assert cfg.checkpoint_dtype == torch.bfloat16
    raw = load_file(str(model_dir / "model.safetensors"))["model.layers.0.self_attn.q_norm.weight"]
    assert raw.dtype == torch.bfloat16
    assert torch.equal(model.model.layers[0].self_attn.q_norm.weight, raw.float())


def test_tensors_are_views_of_one_file_mapping(tmp_path):
    model_dir = build_checkpoint("llama", tmp_path / "m", with_tokenizer=False)
    tensors = dict(read_safetensors(model_dir / "model.safetensors"))
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(storages) == 1  # every tensor is a view into the same mapped file
    expected = load_file(str(model_dir / "model.safetensors"))
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)


def test_fused_expert_tensors_load_like_per_expert_ones(tmp_path):
    per_expert = build_checkpoint("mixtral", tmp_path / "a", with_tokenizer=False)
    fused = copy_dir(per_expert, tmp_path / "b")
    tensors = load_file(str(fused / "model.safetensors"))
    for layer in range(2):
        prefix = f"model.layers.{layer}.block_sparse_moe"
        w1, w3, w2 = (
            [tensors.pop(f"{prefix}.experts.{e}.{w}.weight") for e in range(4)]
            for w in ("w1", "w3", "w2")
        )
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(w1, w3, strict=True)]
        )
        tensors[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(w2)
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = tensors.pop(f"{prefix}.gate.weight")
    save_file(tensors, str(fused / "model.safetensors"))
    a, _ = load_model(per_expert, dtype=torch.float32)
    b, _ = load_model(fused, dtype=torch.float32)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_progress_bar_when_asked(tmp_path, capsys):
    model_dir = build_checkpoint("llama", tmp_path / "m", with_tokenizer=False)
    load_model(model_dir, dtype=torch.float32, progress=True)
    assert "loading weights" in capsys.readouterr().err


def _edit_config(model_dir: Path, **changes) -> None:  # type: ignore[no-untyped-def]
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


@pytest.fixture
def llama_dir(tmp_path, tiny_checkpoint):  # type: ignore[no-untyped-def]
    return copy_dir(tiny_checkpoint("llama"), tmp_path / "m")


def test_unsupported_architecture_is_named(llama_dir):
    _edit_config(llama_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitectureError, match=r"GPT2LMHeadModel.*supported: "):
        load_model(llama_dir, dtype=torch.float32)


def test_missing_tensor_is_named(llama_dir):
    path = llama_dir / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"missing.*layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(llama_dir, dtype=torch.float32)


def test_mismatched_tensor_is_named(llama_dir):
    _edit_config(llama_dir, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj.*does not match"):
        load_model(llama_dir, dtype=torch.float32)


def test_unknown_tensor_is_named(llama_dir):
    path = llama_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.mystery.weight"] = torch.zeros(2)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"mystery.*matches no parameter"):
        load_model(llama_dir, dtype=torch.float32)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_file_is_named(llama_dir, damage):
    path = llama_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*corrupt"):
        load_model(llama_dir, dtype=torch.float32)


def test_not_a_checkpoint_dir(tmp_path):
    with pytest.raises(CheckpointConfigError, match=r"config\.json not found"):
        load_model(tmp_path, dtype=torch.float32)


def test_no_weights(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_model(llama_dir, dtype=torch.float32)
