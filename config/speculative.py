"""The speculative decoding group of the configuration (``SpeculativeConfig``) and its
translation from vLLM's ``--speculative-config`` JSON, with the validation of the dynamic-K
schedule (``num_speculative_tokens_per_batch_size``).

vLLM's JSON keys are the group's fields, except ``method`` (``speculative_method`` here) and
``model`` (``speculative_model``, vLLM's old flag name), which would clash with other groups'
options. ``acceptance_driven_k`` is shoal's own: K follows the acceptance the engine core
observes, bounded by the table (or by ``num_speculative_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from shoal.config.validation import require as _require

METHODS = ("ngram", "draft_model")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both n-gram bounds
SpecSchedule = list[tuple[int, int, int]]
JSON_KEYS = {  # vLLM's key → the group's field
    "method": "speculative_method",
    "model": "speculative_model",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "num_speculative_tokens_per_batch_size": "num_speculative_tokens_per_batch_size",
    "acceptance_driven_k": "acceptance_driven_k",
}


class SpeculativeConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Speculative decoding: ``speculative_method`` None is off. ``ngram`` drafts from the
    request's own tokens; ``draft_model`` runs ``speculative_model`` (a small checkpoint with the
    target's tokenizer) beside the target in each worker."""

    speculative_method: str | None = None
    num_speculative_tokens: int = 0  # K, the most drafts verified per request and step
    prompt_lookup_min: int | None = None  # n-gram bounds (both 5 when unset; one copies the other)
    prompt_lookup_max: int | None = None
    speculative_model: str | None = None  # the draft checkpoint (draft_model)
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    acceptance_driven_k: bool = False

    def __post_init__(self) -> None:
        method = self.speculative_method
        if method is None:
            _require(
                _all_defaults(self),
                "speculative_config.method",
                "is required (one of ngram, draft_model) when any other key is given",
            )
            return
        _require(
            method in METHODS,
            "speculative_config.method",
            f"must be one of {', '.join(METHODS)}, got {method!r}",
        )
        _require(
            self.num_speculative_tokens >= 1,
            "speculative_config.num_speculative_tokens",
            f"must be a positive integer, got {self.num_speculative_tokens}",
        )
        self._check_method_options(method)
        if self.num_speculative_tokens_per_batch_size is not None:
            try:
                schedule = validate_spec_schedule(self.num_speculative_tokens_per_batch_size)
            except ValueError as exc:  # name the key, once
                text = str(exc) if str(exc).startswith(_SCHEDULE) else f"{_SCHEDULE}: {exc}"
                raise ValueError(f"speculative_config.{text}") from None
            msgspec.structs.force_setattr(
                self, "num_speculative_tokens_per_batch_size", tuple(schedule)
            )

    def _check_method_options(self, method: str) -> None:
        if method == "draft_model":
            _require(
                bool(self.speculative_model),
                "speculative_config.model",
                "is required with method draft_model (the draft checkpoint)",
            )
            return
        _require(
            self.speculative_model is None,
            "speculative_config.model",
            "is only used by method draft_model",
        )
        low, high = _lookup_bounds(self.prompt_lookup_min, self.prompt_lookup_max)
        for option, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            _require(value >= 1, f"speculative_config.{option}", f"must be >= 1, got {value}")
        _require(
            high >= low,
            "speculative_config.prompt_lookup_max",
            f"must be >= prompt_lookup_min ({low}), got {high}",
        )
        msgspec.structs.force_setattr(self, "prompt_lookup_min", low)
        msgspec.structs.force_setattr(self, "prompt_lookup_max", high)

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past the verified tokens a draft model writes while proposing."""
        return self.num_speculative_tokens if self.speculative_method == "draft_model" else 0


_SCHEDULE = "num_speculative_tokens_per_batch_size"


def _all_defaults(group: SpeculativeConfig) -> bool:
    """Whether every field is at its default (speculative decoding off, nothing else said)."""
    return all(
        getattr(group, name) == default
        for name, default in zip(group.__struct_fields__, group.__struct_defaults__, strict=True)
    )


def _lookup_bounds(low: int | None, high: int | None) -> tuple[int, int]:
    """The n-gram bounds as vLLM sets them: both 5 when unset, one copies the other (0 is a
    value, refused later, not "unset")."""
    if low is None:
        low = DEFAULT_PROMPT_LOOKUP if high is None else high
    return low, low if high is None else high


def speculative_options(value: dict[str, Any] | SpeculativeConfig) -> dict[str, Any]:
    """Flat options from vLLM's ``--speculative-config`` JSON (or ``LLM(speculative_config=)``).
    ``method`` may be left out when ``model`` names a draft checkpoint."""
    if isinstance(value, SpeculativeConfig):
        return msgspec.structs.asdict(value)
    _require(isinstance(value, dict), "speculative_config", f"must be a JSON object, got {value!r}")
    for key in value:
        known = ", ".join(JSON_KEYS)
        _require(
            key in JSON_KEYS, f"speculative_config.{key}", f"is an unknown key; known: {known}"
        )
    options = {JSON_KEYS[key]: v for key, v in value.items()}
    if options.get("speculative_method") is None and options.get("speculative_model"):
        options["speculative_method"] = "draft_model"
    try:
        group = msgspec.convert(options, SpeculativeConfig)
    except msgspec.ValidationError as exc:  # a wrong type, or the group's own checks
        text = str(exc)
        for key, field in JSON_KEYS.items():  # vLLM's key names the field in the message
            text = text.replace(f"`$.{field}`", f"`$.{key}`")
        prefixed = text if text.startswith("speculative_config") else f"speculative_config: {text}"
        raise ValueError(prefixed) from None
    return msgspec.structs.asdict(group)


def _parse_entry(entry: object) -> tuple[int, int, int]:
    """One ``(start, end, K)`` entry as ints, or ``ValueError`` naming the entry."""
    if isinstance(entry, str | bytes) or not isinstance(entry, Sequence) or len(entry) != 3:
        raise ValueError(
            f"each schedule entry must be a 3-item sequence [start, end, K]; got {entry!r}"
        )
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in entry):
        raise ValueError(f"schedule entry values must be integers; got {entry!r}")
    start, end, k = (int(v) for v in entry)
    if start <= 0 or end <= 0:
        raise ValueError(f"batch-size bounds must be positive in {entry!r}")
    if start > end:
        raise ValueError(f"batch-size range start must be <= end in {entry!r}")
    if k < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0 in {entry!r}")
    return start, end, k


def validate_spec_schedule(entries: object) -> SpecSchedule:
    """The schedule as sorted ``(start, end, K)`` tuples; ``ValueError`` if it is invalid.

    Like vLLM's ``validate_and_normalize_dynamic_sd_schedule``: entries are sorted by start
    (normalisation), then must not overlap, and the first range must start at 1 so every
    runtime batch size has a K.
    """
    if isinstance(entries, str | bytes) or not isinstance(entries, Sequence) or not entries:
        raise ValueError(
            f"num_speculative_tokens_per_batch_size must be a non-empty list; got {entries!r}"
        )
    schedule = sorted((_parse_entry(e) for e in entries), key=lambda e: e[0])
    previous: tuple[int, int, int] | None = None
    for entry in schedule:
        if previous is not None and entry[0] <= previous[1]:
            raise ValueError(
                f"batch-size ranges must be sorted and non-overlapping: "
                f"{list(previous)!r} overlaps {list(entry)!r}"
            )
        previous = entry
    if schedule[0][0] != 1:
        raise ValueError(f"the first batch-size range must start at 1; got {list(schedule[0])!r}")
    return schedule
