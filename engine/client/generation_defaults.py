"""The default sampling parameters a model's ``generation_config.json`` recommends, as vLLM takes
them (``--generation-config``, ``ModelConfig.get_diff_sampling_param``).

With ``auto`` (the default) they come from the model directory's file, with a directory from
that directory's file, with ``vllm`` from nowhere. vLLM reads ``repetition_penalty``,
``temperature``, ``top_k``, ``top_p`` and ``min_p``, each the default of a request that leaves it
unset, and ``max_new_tokens``: the ``max_tokens`` of a request that sets none (a chat request, a
completion with ``max_tokens: null``; completions default to 16 as in vLLM), never more than
the room left in the context. From a directory given by name it is also a bound on every
request's ``max_tokens`` (vLLM's ``override_max_tokens``). Offline, ``LLM.generate`` without
sampling parameters starts from all of them (vLLM's ``get_default_sampling_params``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from shoal.bus.messages.sampling import SamplingParams
from shoal.config.deployment import GENERATION_CONFIG_AUTO, GENERATION_CONFIG_NONE

SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
MAX_NEW_TOKENS = "max_new_tokens"  # Hugging Face's name of vLLM's max_tokens
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    sampling: Mapping[str, float | int] = field(default_factory=dict)
    max_tokens: int | None = None  # for a request that sets none
    max_tokens_bound: int | None = None  # for every request (a directory given by name)

    def __bool__(self) -> bool:
        return bool(self.sampling) or self.max_tokens is not None

    def under(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """``given`` (a request's set fields) over the defaults."""
        return {**self.sampling, **given}

    def bound_max_tokens(self, requested: int | None, resolved: int) -> int:
        """A request's ``max_tokens`` (``resolved``: what it asked for, or the room left when it
        asked for none) under the defaults."""
        bounds = [resolved, self.max_tokens_bound]
        if requested is None:
            bounds.append(self.max_tokens)
        return min(bound for bound in bounds if bound is not None)

    def sampling_params(self) -> SamplingParams:
        """Offline sampling parameters when none are given."""
        return SamplingParams(**self.describe())

    def describe(self) -> dict[str, Any]:
        """The defaults in vLLM's names (what vLLM logs)."""
        max_tokens = {} if self.max_tokens is None else {"max_tokens": self.max_tokens}
        return {**self.sampling, **max_tokens}


def defaults_from(config: Mapping[str, Any], bounds_every_request: bool) -> GenerationDefaults:
    """The defaults of one ``generation_config.json``'s contents (null values are unset), typed
    and checked as sampling parameters (``ValueError`` naming a bad one)."""
    given = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if config.get(MAX_NEW_TOKENS) is not None:
        given["max_tokens"] = config[MAX_NEW_TOKENS]
    try:
        typed = msgspec.convert(given, SamplingParams, strict=False)
    except msgspec.ValidationError as error:
        raise ValueError(f"{GENERATION_CONFIG_FILE}: {error}") from None
    sampling = {key: getattr(typed, key) for key in given if key != "max_tokens"}
    max_tokens = typed.max_tokens if "max_tokens" in given else None
    bound = max_tokens if bounds_every_request else None
    return GenerationDefaults(sampling, max_tokens, bound)


def read_generation_defaults(model_dir: Path, setting: str) -> GenerationDefaults:
    """The defaults for ``--generation-config setting`` (none where the file is absent)."""
    if setting == GENERATION_CONFIG_NONE:
        return GenerationDefaults()
    given_dir = setting != GENERATION_CONFIG_AUTO
    path = (Path(setting) if given_dir else model_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return GenerationDefaults()
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return defaults_from(config, bounds_every_request=given_dir)
