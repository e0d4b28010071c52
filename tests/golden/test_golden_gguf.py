"""GGUF checkpoints: files written here as llama.cpp's converter writes them (every listed
quantization, every served family) load to exactly the dequantized weights, and greedy outputs
equal transformers' on those weights token for token; transformers' own GGUF reader agrees where
it reads the family; the view's tokenizer, chat template and ids come from the metadata; files
shoal cannot serve are refused by name.

Q4_0/Q4_1/Q8_0 weights stay quantized by default: here the quantized kernel runs exact (fp32,
``SHOAL_QUANT_DTYPE``), so the token-for-token comparisons hold; test_golden_quantized covers
the bf16 default."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from shoal.deploy.model_source import resolve_model
from shoal.kernels import quant_gemm
from shoal.workers.gguf import GGUFError, find_gguf_file, gguf_source, gguf_view
from shoal.workers.loader import load_model
from tests.fixtures.gguf_files import CHAT_TEMPLATE, QUANT_TYPES, save_reference, write_gguf
from tests.fixtures.models import VARIANTS, build_checkpoint, hf_greedy, make_prompts
from tests.golden.driver import generate_by_hand, make_runner

BLOCK = 4
MAX_NEW = 8
# Rows of 256 and 512 so that every K-quant block (256 values) fits.
WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64)


@pytest.fixture(autouse=True)
def exact_quantized_kernel(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(quant_gemm.ENV_VAR, "float32")


def converted(tmp: Path, variant: str, qtype: str, **overrides: object) -> tuple[Path, Path, Path]:
    """(the GGUF file, its view directory, the reference checkpoint of its dequantized weights)."""
    model_dir = build_checkpoint(variant, tmp / "hf", **overrides)
    (tmp / "gguf").mkdir()
    gguf_file, reference = write_gguf(model_dir, tmp / "gguf" / f"{variant}-{qtype}.gguf", qtype)
    view = gguf_view(gguf_file, cache_root=tmp / "cache")
    return gguf_file, view, save_reference(model_dir, reference, tmp / "reference")


def greedy_outputs(model_dir: Path) -> list[list[int]]:
    runner = make_runner(model_dir, num_blocks=128, block_size=BLOCK)
    runner.load()
    return generate_by_hand(runner, make_prompts(), MAX_NEW, BLOCK)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_each_quantization_loads_the_dequantized_weights(qtype, tmp_path):
    """Llama with Llama 3 rope scaling (``rope_freqs``) and permuted q/k rows."""
    gguf_file, view, reference = converted(tmp_path, "llama", qtype, **WIDE)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(gguf_file)).tensors}
    assert qtype in kinds  # the weights really are stored in that type
    ours, _ = load_model(view, dtype=torch.float32, dequantize=True)
    expected, _ = load_model(reference, dtype=torch.float32)
    expected_params = dict(expected.named_parameters())
    assert dict(ours.named_parameters()).keys() == expected_params.keys()
    for name, param in ours.named_parameters():
        assert torch.equal(param, expected_params[name]), name
    assert greedy_outputs(view) == hf_greedy(reference, make_prompts(), MAX_NEW)  # kept quantized


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_family_matches_transformers(variant, tmp_path):
    _, view, reference = converted(tmp_path, variant, "Q8_0")
    assert greedy_outputs(view) == hf_greedy(reference, make_prompts(), MAX_NEW)


@pytest.mark.parametrize("variant", ["llama_tied", "mistral", "qwen2"])
def test_transformers_gguf_reader_agrees(variant, tmp_path):
    """transformers reads the same file to the same weights (so the files are llama.cpp's
    layout, q/k permutation included) and generates shoal's tokens."""
    import transformers

    gguf_file, view, reference = converted(tmp_path, variant, "Q4_1")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    reference_weights = transformers.AutoModelForCausalLM.from_pretrained(str(reference))
    expected = reference_weights.state_dict()
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    ours = greedy_outputs(view)
    theirs.generation_config.eos_token_id = None
    for prompt, tokens in zip(make_prompts(), ours, strict=True):
        ids = torch.tensor([prompt])
        out = theirs.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW
        )
        assert out[0, len(prompt) :].tolist() == tokens


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_1"])
def test_tensor_parallel_ranks_shard_a_gguf_model(qtype, tmp_path):
    """Two TP ranks (processes) each load their half of the weights: Q4_K dequantized, Q4_1
    kept quantized (rows of the column-parallel layers, whole groups of the row-parallel
    ones)."""
    from tests.unit.test_model_runner_tp import run_tp

    _, view, reference = converted(tmp_path, "llama", qtype, **WIDE)
    expected = hf_greedy(reference, make_prompts(), MAX_NEW)
    results = run_tp(view)
    for rank in (0, 1):
        outputs, shapes, _, error = results[rank]
        assert error is None, f"rank {rank}: {error}"
        assert shapes["qkv"] == ((2 + 2 * 1) * 64, 256)  # 2 of the 4 q heads, 1 of 2 kv heads
        kept = "Q4_1 as int4 (group 32): 9" if qtype == "Q4_1" else "float32: 9"
        assert shapes["linear_weights"] == kept
        assert outputs == expected


def test_the_view_holds_the_files_metadata(tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    gguf_file, view, _ = converted(tmp_path, "qwen3_moe", "Q8_0")
    assert gguf_source(view) == gguf_file.resolve()
    config = (view / "config.json").read_text()
    assert '"Qwen3MoeForCausalLM"' in config and '"mlp_only_layers": [\n    1\n  ]' in config
    # The vocabulary, merges and pre-tokenizer as the original (transformers may put its own
    # class for a family on top of both alike).
    converted_bpe = Tokenizer.from_file(str(view / "tokenizer.json"))
    original_bpe = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    for text in ("the quick brown fox", "0123 + 45 = ?", "tokens, token by token!</s>"):
        assert converted_bpe.encode(text).ids == original_bpe.encode(text).ids
    ours = AutoTokenizer.from_pretrained(str(view))
    assert ours.chat_template == CHAT_TEMPLATE
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    assert (view / "generation_config.json").read_text().count('"eos_token_id": 2') == 1
    # The same file gets the same view; a changed one a new view.
    assert gguf_view(gguf_file, cache_root=tmp_path / "cache") == view
    gguf_file.touch()
    assert gguf_view(gguf_file, cache_root=tmp_path / "cache") != view


def test_model_arguments_resolve_to_the_view(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file, _, _ = converted(tmp_path, "qwen2", "Q8_0")
    by_file = resolve_model(str(gguf_file))
    by_dir = resolve_model(str(gguf_file.parent))  # a directory holding one GGUF file
    assert Path(by_file.directory) == Path(by_dir.directory)
    assert gguf_source(by_file.directory) == gguf_file.resolve()
    assert by_file.served_name == str(gguf_file)  # clients call it what the user typed
    hf = resolve_model(str(tmp_path / "hf"))
    assert (hf.directory, hf.served_name) == (str(tmp_path / "hf"), None)
    (gguf_file.parent / "other.gguf").write_bytes(gguf_file.read_bytes())
    with pytest.raises(GGUFError, match="several GGUF files"):
        find_gguf_file(gguf_file.parent)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not found"):
        resolve_model(str(not_gguf))


def write_raw(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (data, kind) in tensors.items():
        raw = None if kind == "F32" else gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path):
    from shoal.workers.gguf.reader import GGUFFile

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q2_K]
    path = write_raw(
        tmp_path / "q2k.gguf",
        "llama",
        {
            "token_embd.weight": (np.zeros((4, 256 // block * size), np.uint8), "Q2_K"),
            "output_norm.weight": (np.ones(256, np.float32), "F32"),
        },
    )
    with pytest.raises(GGUFError, match=r"Q2_K \(token_embd.weight\) not supported"):
        GGUFFile(path)


def test_an_unsupported_architecture_is_refused_by_name(tmp_path):
    path = write_raw(tmp_path / "gpt2.gguf", "gpt2", {"x.weight": (np.ones(4, np.float32), "F32")})
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        gguf_view(path, cache_root=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").glob("gpt2*"))  # nothing half-built left
