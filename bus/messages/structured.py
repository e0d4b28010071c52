"""Structured outputs on the wire: what a request's output must match
(``StructuredOutputsParams``, vLLM's names: exactly one of ``json``, ``regex``, ``choice``,
``grammar``, ``json_object``), and the per-step token bitmask the engine core sends its workers
for the requests that sample under a grammar (``GrammarBitmask``)."""

from __future__ import annotations

from typing import Any

import msgspec

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """The constraint on one request's output. ``json``: a JSON schema (an object, or its JSON
    text); ``regex``: a regular expression; ``choice``: one of these strings exactly;
    ``grammar``: an EBNF grammar (xgrammar's dialect, GBNF-like, rule ``root``);
    ``json_object``: any JSON object. ``ValueError`` unless exactly one is set."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # No whitespace outside strings in JSON output (shorter output, same meaning).
    disable_any_whitespace: bool = False
    # A reasoning model's parser (deepseek_r1, qwen3): the constraint applies after its
    # <think>...</think> (the gateway sets it with --reasoning-parser, as vLLM does).
    after_reasoning: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must hold at least one string")

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))


class GrammarBitmask(msgspec.Struct, array_like=True, gc=False):
    """Which tokens each listed request may sample this step: ``data`` holds one row of
    ``words`` little-endian int32 per entry of ``req_ids`` (bit ``t % 32`` of word ``t // 32``
    set: token ``t`` allowed), xgrammar's layout. A request verifying ``n`` drafts is listed
    ``n + 1`` times in a row, one per position it samples at. Requests not listed are free."""

    req_ids: list[str]
    words: int
    data: bytes


class StepGrammar(msgspec.Struct, tag="step_grammar", array_like=True, gc=False):
    """The bitmask of step ``step_id``, sent after the step itself (``ExecuteStep.grammar_later``:
    under async scheduling a grammar request's mask needs the token of the step before, which
    lands while this one runs; the worker runs its forward pass meanwhile and waits for this
    before sampling). ``bitmask`` None: no row to mask (its requests ended meanwhile)."""

    step_id: int
    bitmask: GrammarBitmask | None = None
