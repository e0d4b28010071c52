"""Facts the engine side reads straight from a model directory's ``config.json`` (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_MAX_MODEL_LEN = 2048


def read_model_config(model_dir: Path) -> dict[str, object]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def read_text_config(model_dir: Path) -> dict[str, object]:
    """The language model's part of ``config.json`` (its ``text_config`` where it has one)."""
    config = read_model_config(model_dir)
    text_config = config.get("text_config")
    return text_config if isinstance(text_config, dict) else config


def read_max_model_len(model_dir: Path) -> int:
    """The model's context length (``max_position_embeddings``), or a default."""
    value = read_text_config(model_dir).get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else DEFAULT_MAX_MODEL_LEN


def read_vocab_size(model_dir: Path) -> int | None:
    """The rows of the model's embedding and columns of its logits (``vocab_size``), if given."""
    value = read_text_config(model_dir).get("vocab_size")
    return value if isinstance(value, int) and value > 0 else None


def read_num_layers(model: str) -> int | None:
    """The model's decoder layers (``num_hidden_layers``) when ``model`` is a folder with a
    ``config.json`` saying so; None otherwise (a GGUF file, a name)."""
    try:
        value = read_text_config(Path(model)).get("num_hidden_layers")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sentence_transformers_pooling(model_dir: Path) -> dict[str, object] | None:
    """The pooling a sentence-transformers model declares (``modules.json``: its Pooling
    module's mode, and whether a Normalize module follows), as vLLM's ``--pooler-config``
    fields; None without one."""
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return None
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling = kinds.get("Pooling")
    if pooling is None:
        return None
    config = _read_json(model_dir / str(pooling.get("path", "")) / "config.json")
    if not isinstance(config, dict):
        return None
    modes = {
        "pooling_mode_cls_token": "CLS",
        "pooling_mode_mean_tokens": "MEAN",
        "pooling_mode_lasttoken": "LAST",
    }
    kind = next((name for key, name in modes.items() if config.get(key)), None)
    if kind is None:
        return None
    return {"pooling_type": kind, "normalize": "Normalize" in kinds}


def is_matryoshka(model_dir: Path) -> bool:
    """Whether the model was trained for truncated embeddings (``dimensions`` may shorten them:
    vLLM's ``is_matryoshka`` / ``matryoshka_dimensions`` in config.json)."""
    try:
        config = read_text_config(model_dir)
    except (OSError, ValueError):
        return False
    return bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
