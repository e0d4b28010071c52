"""``--generation-config`` as vLLM reads it, without a model: which file (the model's, none, a
named directory's), which fields (vLLM's five plus ``max_new_tokens``), typed and checked, and
how ``max_tokens`` is bounded (a default for requests that set none; from a named directory, a
bound on every request)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.bus.messages.sampling import SamplingParams
from shoal.engine.client.generation_defaults import GenerationDefaults, read_generation_defaults

RECOMMENDED = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "min_p": 0.0,
    "repetition_penalty": 1.1,
    "max_new_tokens": 5,
    "eos_token_id": 2,
    "do_sample": True,
}
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.1}


def _model_dir(path: Path, config: dict[str, object] | None) -> Path:
    path.mkdir()
    if config is not None:
        (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_auto_reads_the_models_file_and_vllm_reads_none(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "model", RECOMMENDED)
    auto = read_generation_defaults(model, "auto")
    assert auto == GenerationDefaults(SAMPLING, max_tokens=5, max_tokens_bound=None)
    assert read_generation_defaults(model, "vllm") == GenerationDefaults()
    assert not read_generation_defaults(_model_dir(tmp_path / "bare", None), "auto")
    eos_only = _model_dir(tmp_path / "eos", {"eos_token_id": 2, "temperature": None})
    assert not read_generation_defaults(eos_only, "auto")


def test_a_named_directory_is_read_instead_and_bounds_every_request(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "model", {"temperature": 1.5})
    other = _model_dir(tmp_path / "other", RECOMMENDED)
    named = read_generation_defaults(model, str(other))
    assert named.sampling == SAMPLING and named.max_tokens_bound == 5
    assert named.bound_max_tokens(16, 16) == 5  # a completion's 16
    assert named.bound_max_tokens(None, 100) == 5
    auto = read_generation_defaults(other, "auto")
    assert auto.bound_max_tokens(16, 16) == 16  # set: the default does not apply
    assert auto.bound_max_tokens(None, 100) == 5  # unset: the default, within the room
    assert auto.bound_max_tokens(None, 3) == 3


def test_unset_fields_take_the_defaults_and_set_ones_win() -> None:
    defaults = GenerationDefaults({"temperature": 0.0, "top_k": 20}, max_tokens=5)
    assert defaults.under({"temperature": 0.9}) == {"temperature": 0.9, "top_k": 20}
    assert defaults.sampling_params() == SamplingParams(temperature=0.0, top_k=20, max_tokens=5)
    assert GenerationDefaults().sampling_params() == SamplingParams()


def test_values_are_typed_and_checked_as_sampling_parameters(tmp_path: Path) -> None:
    lax = _model_dir(tmp_path / "lax", {"top_k": 20.0, "temperature": 0, "top_p": 1})
    typed = read_generation_defaults(lax, "auto").sampling
    assert typed == {"top_k": 20, "temperature": 0.0, "top_p": 1.0}
    assert type(typed["top_k"]) is int and type(typed["temperature"]) is float
    for bad, field in (({"top_p": 0}, "top_p"), ({"max_new_tokens": 0}, "max_tokens")):
        path = _model_dir(tmp_path / field, bad)
        with pytest.raises(ValueError, match=field):
            read_generation_defaults(path, "auto")
