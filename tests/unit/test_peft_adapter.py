"""PEFT adapter checks (``config.peft_adapter``) on folders built by hand, and ``LoRAConfig``."""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from shoal.config.lora import LoRAConfig, LoRAModule, parse_lora_module
from shoal.config.peft_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoRAAdapterError,
    PeftAdapterConfig,
    check_adapter,
    read_config,
    read_safetensors_header,
)

HIDDEN = 32
PREFIX = "base_model.model.model.layers"


def peft_config(**overrides: Any) -> dict[str, Any]:
    """An adapter_config.json as PEFT writes it (with fields shoal ignores)."""
    config: dict[str, Any] = {
        "alpha_pattern": {},
        "base_model_name_or_path": "tiny-llama",
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": 8,
        "rank_pattern": {},
        "target_modules": ["q_proj", "v_proj"],
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }
    config.update(overrides)
    return config


def lora_pair(module: str, rank: int = 8, out: int = HIDDEN) -> dict[str, torch.Tensor]:
    """PEFT's A [r, in] and B [out, r] of ``module`` (its name after ``base_model.model.``)."""
    return {
        f"base_model.model.{module}.lora_A.weight": torch.zeros(rank, HIDDEN),
        f"base_model.model.{module}.lora_B.weight": torch.zeros(out, rank),
    }


def default_tensors(rank: int = 8) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(2):
        tensors |= lora_pair(f"model.layers.{layer}.self_attn.q_proj", rank)
        tensors |= lora_pair(f"model.layers.{layer}.self_attn.v_proj", rank, out=16)
    return tensors


def make_adapter(
    folder: Path,
    config: dict[str, Any] | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(peft_config() if config is None else config))
    save_file(default_tensors() if tensors is None else tensors, str(folder / WEIGHTS_FILE))
    return folder


@pytest.fixture
def adapter(tmp_path: Path) -> Path:
    return make_adapter(tmp_path / "sql-lora")


# ----- a valid adapter


def test_a_valid_adapter_passes_and_returns_its_config(adapter: Path) -> None:
    config = check_adapter(adapter, max_lora_rank=16, num_layers=2)
    assert isinstance(config, PeftAdapterConfig)
    assert config.r == 8 and config.lora_alpha == 16.0
    assert config.target_modules == ["q_proj", "v_proj"]
    assert config.base_model_name_or_path == "tiny-llama"
    assert check_adapter(str(adapter), max_lora_rank=8) == config  # a str path, no layer check


def test_the_header_lists_every_tensor_with_dtype_and_shape(adapter: Path) -> None:
    header = read_safetensors_header(adapter / WEIGHTS_FILE)
    assert len(header) == 8
    assert header[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"] == ("F32", (8, HIDDEN))
    assert header[f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"] == ("F32", (16, 8))


@pytest.mark.parametrize("target", ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
def test_every_projection_shoal_applies_is_accepted(tmp_path: Path, target: str) -> None:
    part = "self_attn" if target in ("k_proj", "o_proj") else "mlp"
    folder = make_adapter(tmp_path, tensors=lora_pair(f"model.layers.0.{part}.{target}"))
    check_adapter(folder, max_lora_rank=8, num_layers=1)


def test_peft_default_adapter_names_are_accepted(tmp_path: Path) -> None:
    tensors = {
        f"{PREFIX}.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(8, HIDDEN),
        f"{PREFIX}.0.self_attn.q_proj.lora_B.default.weight": torch.zeros(HIDDEN, 8),
    }
    check_adapter(make_adapter(tmp_path, tensors=tensors), max_lora_rank=8, num_layers=1)


# ----- the folder and its config


def test_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LoRAAdapterError, match="no such adapter folder"):
        check_adapter(tmp_path / "nowhere", max_lora_rank=16)


def test_a_folder_without_a_config_is_refused(adapter: Path) -> None:
    (adapter / CONFIG_FILE).unlink()
    with pytest.raises(LoRAAdapterError, match=f"no {CONFIG_FILE}.*not a PEFT adapter"):
        check_adapter(adapter, max_lora_rank=16)


@pytest.mark.parametrize("text", ["{not json", '["r", 8]', '{"r": "eight"}'])
def test_an_invalid_config_is_refused(adapter: Path, text: str) -> None:
    (adapter / CONFIG_FILE).write_text(text)
    with pytest.raises(LoRAAdapterError, match="not a valid adapter config"):
        check_adapter(adapter, max_lora_rank=16)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"modules_to_save": ["lm_head"]}, r"modules_to_save \['lm_head'\] are not supported"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
    ],
)
def test_unsupported_config_options_are_refused(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    folder = make_adapter(tmp_path, config=peft_config(**overrides))
    with pytest.raises(LoRAAdapterError, match=message):
        check_adapter(folder, max_lora_rank=16)
    with pytest.raises(LoRAAdapterError, match=message):
        read_config(folder)


def test_an_empty_modules_to_save_and_lowercase_peft_type_are_fine(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path, config=peft_config(modules_to_save=[], peft_type="lora"))
    check_adapter(folder, max_lora_rank=16)


def test_a_config_with_only_defaults_is_read(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path, config={})
    config = check_adapter(folder, max_lora_rank=16)
    assert config.r == 8 and config.lora_alpha == 8.0 and config.peft_type == "LORA"


# ----- the tensors


@pytest.mark.parametrize("which", ["lora_A", "lora_B"])
def test_a_rank_above_max_lora_rank_is_refused(tmp_path: Path, which: str) -> None:
    tensors = default_tensors()
    module = f"{PREFIX}.1.self_attn.v_proj"
    if which == "lora_A":
        tensors[f"{module}.lora_A.weight"] = torch.zeros(32, HIDDEN)
    else:
        tensors[f"{module}.lora_B.weight"] = torch.zeros(16, 32)
    folder = make_adapter(tmp_path, tensors=tensors)
    with pytest.raises(LoRAAdapterError) as info:
        check_adapter(folder, max_lora_rank=16)
    message = str(info.value)
    assert "rank 32" in message and "max_lora_rank 16" in message
    assert "--max-lora-rank" in message and "model.layers.1.self_attn.v_proj" in message
    check_adapter(folder, max_lora_rank=32)  # fits a larger limit


def test_a_rank_equal_to_max_lora_rank_is_fine(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path, tensors=default_tensors(rank=16))
    check_adapter(folder, max_lora_rank=16)
    with pytest.raises(LoRAAdapterError, match="rank 16"):
        check_adapter(folder, max_lora_rank=8)


@pytest.mark.parametrize(
    ("module", "named"),
    [
        ("transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_attn"),
        ("model.layers.0.self_attn.c_attn", "model.layers.0.self_attn.c_attn"),
        ("lm_head", "lm_head"),
        ("model.embed_tokens", "model.embed_tokens"),
        ("model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.qkv_proj"),
    ],
)
def test_a_module_shoal_cannot_apply_is_refused(tmp_path: Path, module: str, named: str) -> None:
    tensors = default_tensors() | lora_pair(module)
    folder = make_adapter(tmp_path, tensors=tensors)
    with pytest.raises(LoRAAdapterError, match="target module") as info:
        check_adapter(folder, max_lora_rank=16)
    assert repr(named) in str(info.value) and "q_proj" in str(info.value)  # lists what works


def test_a_layer_the_model_does_not_have_is_refused(adapter: Path) -> None:
    check_adapter(adapter, max_lora_rank=16, num_layers=2)
    with pytest.raises(LoRAAdapterError, match="no such layer") as info:
        check_adapter(adapter, max_lora_rank=16, num_layers=1)
    assert "model.layers.1." in str(info.value) and "(1 layers)" in str(info.value)


def test_a_module_outside_any_layer_is_refused_when_the_layers_are_known(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path, tensors=lora_pair("model.q_proj"))
    check_adapter(folder, max_lora_rank=16)  # no layer count: not checked
    with pytest.raises(LoRAAdapterError, match="no such layer"):
        check_adapter(folder, max_lora_rank=16, num_layers=4)


def test_a_tensor_that_is_not_a_lora_weight_is_refused(tmp_path: Path) -> None:
    tensors = default_tensors()
    tensors[f"{PREFIX}.0.self_attn.q_proj.weight"] = torch.zeros(HIDDEN, HIDDEN)
    folder = make_adapter(tmp_path, tensors=tensors)
    with pytest.raises(LoRAAdapterError, match="is not a LoRA weight"):
        check_adapter(folder, max_lora_rank=16)


def test_a_lora_weight_that_is_not_a_matrix_is_refused(tmp_path: Path) -> None:
    tensors = default_tensors()
    tensors[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(8)
    folder = make_adapter(tmp_path, tensors=tensors)
    with pytest.raises(LoRAAdapterError, match="expected 2 dimensions"):
        check_adapter(folder, max_lora_rank=16)


def test_weights_without_tensors_are_refused(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path, tensors={})
    with pytest.raises(LoRAAdapterError, match="holds no tensors"):
        check_adapter(folder, max_lora_rank=16)


# ----- the safetensors file itself


def test_missing_weights_are_refused(adapter: Path) -> None:
    (adapter / WEIGHTS_FILE).unlink()
    with pytest.raises(LoRAAdapterError, match=f"no {WEIGHTS_FILE}"):
        check_adapter(adapter, max_lora_rank=16)


@pytest.mark.parametrize("cut", [1, 100, 1000])
def test_a_truncated_weights_file_is_refused(adapter: Path, cut: int) -> None:
    path = adapter / WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    with pytest.raises(LoRAAdapterError, match=r"truncated|corrupt"):
        check_adapter(adapter, max_lora_rank=16)


def test_a_file_cut_inside_its_header_is_refused(adapter: Path) -> None:
    path = adapter / WEIGHTS_FILE
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    path.write_bytes(path.read_bytes()[: 8 + length // 2])
    with pytest.raises(LoRAAdapterError, match="corrupt safetensors header"):
        check_adapter(adapter, max_lora_rank=16)


@pytest.mark.parametrize("size", [0, 5])
def test_a_file_shorter_than_its_length_prefix_is_refused(adapter: Path, size: int) -> None:
    (adapter / WEIGHTS_FILE).write_bytes(b"\x01" * size)
    with pytest.raises(LoRAAdapterError, match="truncated"):
        check_adapter(adapter, max_lora_rank=16)


@pytest.mark.parametrize("seed", range(4))
def test_a_file_of_random_bytes_is_refused(adapter: Path, seed: int) -> None:
    (adapter / WEIGHTS_FILE).write_bytes(random.Random(seed).randbytes(4096))
    with pytest.raises(LoRAAdapterError, match=r"not a safetensors file|corrupt|truncated"):
        check_adapter(adapter, max_lora_rank=16)


@pytest.mark.parametrize("seed", range(4))
def test_random_bytes_after_a_plausible_length_are_refused(adapter: Path, seed: int) -> None:
    body = random.Random(seed).randbytes(4096)
    (adapter / WEIGHTS_FILE).write_bytes(struct.pack("<Q", 200) + body)
    with pytest.raises(LoRAAdapterError, match="corrupt"):
        check_adapter(adapter, max_lora_rank=16)


def test_an_entry_without_offsets_is_refused(adapter: Path) -> None:
    header = json.dumps({"t.lora_A.weight": {"dtype": "F32", "shape": [8, 4]}}).encode()
    (adapter / WEIGHTS_FILE).write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(LoRAAdapterError, match=r"corrupt entry for tensor 't\.lora_A\.weight'"):
        check_adapter(adapter, max_lora_rank=16)


def _raw_safetensors(path: Path, header: object) -> None:
    data = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(data)) + data)


@pytest.mark.parametrize("case", ["header-is-a-list", "shape-of-strings", "a-directory"])
def test_odd_weights_files_are_refused_as_adapter_errors(adapter: Path, case: str) -> None:
    path = adapter / WEIGHTS_FILE
    if case == "header-is-a-list":
        _raw_safetensors(path, [])
    elif case == "shape-of-strings":
        entry = {"dtype": "F32", "shape": ["a", "b"], "data_offsets": [0, 0]}
        _raw_safetensors(path, {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": entry})
    else:
        path.unlink()
        path.mkdir()
    with pytest.raises(LoRAAdapterError):
        check_adapter(adapter, max_lora_rank=16)


# ----- scaling


MODULE = "model.layers.0.self_attn.q_proj"


def test_scaling_is_alpha_over_rank() -> None:
    config = PeftAdapterConfig(r=8, lora_alpha=16)
    assert config.scaling(MODULE, 8) == 2.0
    assert config.scaling(MODULE, 4) == 4.0  # the module's own rank (rank_pattern)


def test_rslora_scaling_is_alpha_over_the_root_of_rank() -> None:
    config = PeftAdapterConfig(r=16, lora_alpha=16, use_rslora=True)
    assert config.scaling(MODULE, 16) == pytest.approx(4.0)
    assert config.scaling(MODULE, 8) == pytest.approx(16 / math.sqrt(8))


def test_alpha_pattern_matching_the_module_wins_over_lora_alpha() -> None:
    config = PeftAdapterConfig(
        r=8,
        lora_alpha=16,
        alpha_pattern={"q_proj": 32, "layers.1.self_attn.q_proj": 64, "proj": 1},
    )
    assert config.alpha_for(MODULE) == 32.0
    assert config.scaling(MODULE, 8) == 4.0
    assert config.alpha_for("model.layers.1.self_attn.q_proj") == 64.0  # the longest key
    assert config.alpha_for("model.layers.0.self_attn.v_proj") == 16.0  # no key names it
    assert config.alpha_for("model.layers.0.mlp.up_proj") == 16.0  # "proj" is no suffix of it


def test_alpha_pattern_from_the_config_file(tmp_path: Path) -> None:
    folder = make_adapter(
        tmp_path, config=peft_config(alpha_pattern={"v_proj": 4}, use_rslora=True, r=16)
    )
    config = check_adapter(folder, max_lora_rank=16)
    assert config.alpha_for("model.layers.1.self_attn.v_proj") == 4.0
    assert config.scaling("model.layers.1.self_attn.v_proj", 16) == pytest.approx(1.0)
    assert config.scaling(MODULE, 16) == pytest.approx(4.0)


# ----- LoRAConfig and --lora-modules


def test_lora_config_defaults() -> None:
    config = LoRAConfig()
    assert not config.enable_lora and config.max_loras == 1 and config.max_lora_rank == 16
    assert config.cpu_capacity == 1
    assert LoRAConfig(max_loras=3, max_cpu_loras=5).cpu_capacity == 5
    assert LoRAConfig(max_loras=3).cpu_capacity == 3


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_loras": 0}, "max_loras must be >= 1, got 0"),
        ({"max_lora_rank": 7}, "max_lora_rank must be one of .*got 7"),
        ({"max_lora_rank": 0}, "max_lora_rank"),
        ({"max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras must be >= max_loras \(4\), got 2"),
        ({"lora_modules": (LoRAModule("sql", "/a/sql"),)}, "lora_modules need enable_lora"),
        (
            {
                "enable_lora": True,
                "lora_modules": (LoRAModule("sql", "/a/sql"), LoRAModule("sql", "/b/sql")),
            },
            "lora_modules repeat a name",
        ),
    ],
)
def test_lora_config_validation(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**fields)


@pytest.mark.parametrize("rank", [1, 8, 16, 32, 64, 128, 256, 320, 512])
def test_vllm_ranks_are_accepted(rank: int) -> None:
    assert LoRAConfig(max_lora_rank=rank).max_lora_rank == rank


def test_lora_config_with_modules() -> None:
    modules = (LoRAModule("sql", "/a/sql"), LoRAModule("chat", "/a/chat", "base"))
    config = LoRAConfig(enable_lora=True, max_loras=2, max_cpu_loras=2, lora_modules=modules)
    assert [m.name for m in config.lora_modules] == ["sql", "chat"]


def test_parse_lora_module_name_equals_path() -> None:
    assert parse_lora_module("sql=/adapters/sql") == LoRAModule("sql", "/adapters/sql")
    assert parse_lora_module("  sql=/a=b  ") == LoRAModule("sql", "/a=b")  # first '=' splits


def test_parse_lora_module_json_form() -> None:
    text = '{"name": "sql", "path": "/adapters/sql", "base_model_name": "tiny"}'
    assert parse_lora_module(text) == LoRAModule("sql", "/adapters/sql", "tiny")
    assert parse_lora_module('{"name": "a", "path": "/p"}') == LoRAModule("a", "/p")


@pytest.mark.parametrize(
    "text",
    [
        "noequals",
        "=x",
        "x=",
        "",
        '{"name": "sql"}',  # no path
        '{"name": "sql", "path": "/p", "rank": 8}',  # an unknown field
    ],
)
def test_parse_lora_module_refuses_bad_strings(text: str) -> None:
    with pytest.raises(ValueError, match="--lora-modules"):
        parse_lora_module(text)


def test_parse_lora_module_refuses_malformed_json() -> None:
    # (msgspec's DecodeError is a ValueError; its message does not name --lora-modules)
    with pytest.raises(ValueError):
        parse_lora_module("{not json")
