"""A request's grammar from its ``StructuredOutputsParams``, built with xgrammar: JSON schema,
any JSON object, regex, a choice of strings, or an EBNF grammar. ``check_grammar`` builds it
once to find mistakes early (the client calls it: a bad schema is refused before any engine
core sees it); ``compile_grammar`` compiles it against a tokenizer (the engine core).

JSON strings never hold what JSON forbids: xgrammar (0.2.8) writes a string with
``minLength``/``maxLength`` as any characters but quote, backslash and line breaks, so raw
control characters (U+0000-U+001F) got through and the output failed strict parsing (a forced
tool call was then lost). ``json_safe_schema`` writes such a string as the equivalent
``pattern`` without them, which xgrammar enforces."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from shoal.bus.messages.structured import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar


class GrammarError(ValueError):
    """The request's schema, regex or grammar is invalid, or xgrammar does not support it."""


def schema_text(params: StructuredOutputsParams) -> str:
    """The JSON schema of ``params.json`` as text (an object is dumped, text is checked),
    made ``json_safe_schema``."""
    schema: Any = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError("structured_outputs.json must be a JSON schema (an object)")
    return json.dumps(json_safe_schema(schema))


_STRING_CONSTRAINTS = ("pattern", "format", "enum", "const")


def json_safe_schema(schema: Any) -> Any:
    """``schema`` with every length-bounded string (``minLength``/``maxLength`` and nothing
    that already fixes its characters) written as a ``pattern`` of as many characters that are
    not control characters."""
    if isinstance(schema, list):
        return [json_safe_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    safe = {key: json_safe_schema(value) for key, value in schema.items()}
    bounded = "minLength" in safe or "maxLength" in safe
    if safe.get("type") == "string" and bounded and not any(k in safe for k in _STRING_CONSTRAINTS):
        low = int(safe.pop("minLength", 0))
        high = safe.pop("maxLength", None)
        safe["pattern"] = f"^[^\\x00-\\x1f]{{{low},{'' if high is None else int(high)}}}$"
    return safe


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (each a quoted literal)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


# Any text but ``</think>``, then ``</think>`` (a thinking that closes), as a regex.
_THINKING = r"([^<]|<[^/]|</[^t]|</t[^h]|</th[^i]|</thi[^n]|</thin[^k]|</think[^>])*</think>"


def with_reasoning(grammar: xgrammar.Grammar, parser: str | None) -> xgrammar.Grammar:
    """``grammar`` after a reasoning model's thinking: deepseek_r1's output starts inside it (the
    prompt opened ``<think>``), qwen3's may open one or not."""
    import xgrammar as xgr

    if parser is None:
        return grammar
    if parser == "deepseek_r1":
        thinking = xgr.Grammar.from_regex(_THINKING)
    elif parser == "qwen3":
        thinking = xgr.Grammar.from_regex(rf"(\s*<think>{_THINKING}\s*)?")
    else:
        raise GrammarError(f"structured_outputs.after_reasoning: no reasoning parser {parser!r}")
    return xgr.Grammar.concat(thinking, grammar)


def build_grammar(params: StructuredOutputsParams) -> xgrammar.Grammar:
    """The xgrammar ``Grammar`` of ``params`` (after the reasoning when it says so);
    ``GrammarError`` naming the mistake."""
    return with_reasoning(_base_grammar(params), params.after_reasoning)


def _base_grammar(params: StructuredOutputsParams) -> xgrammar.Grammar:
    import xgrammar as xgr

    any_whitespace = not params.disable_any_whitespace
    try:
        match params.kind:
            case "json":
                return xgr.Grammar.from_json_schema(
                    schema_text(params), any_whitespace=any_whitespace
                )
            case "json_object":
                return xgr.Grammar.builtin_json_grammar()
            case "regex":
                return xgr.Grammar.from_regex(params.regex or "")
            case "choice":
                return xgr.Grammar.from_ebnf(choice_ebnf(params.choice or []))
            case _:
                return xgr.Grammar.from_ebnf(params.grammar or "")
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar reports every mistake as a RuntimeError
        raise GrammarError(f"invalid structured_outputs.{params.kind}: {_reason(exc)}") from None


def check_grammar(params: StructuredOutputsParams) -> None:
    """``GrammarError`` if ``params`` does not make a grammar."""
    build_grammar(params)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its source location prefix (``[time] file.cc:line: ``)."""
    text = str(exc).strip()
    head, sep, rest = text.partition(": ")
    return rest if sep and ".cc:" in head else text


def compile_grammar(
    compiler: xgrammar.GrammarCompiler, params: StructuredOutputsParams
) -> xgrammar.CompiledGrammar:
    """``params``' grammar compiled against the compiler's tokenizer (which caches it by
    schema, regex or grammar text: the same constraint compiles once)."""
    if params.after_reasoning is not None:
        return compiler.compile_grammar(build_grammar(params))
    any_whitespace = not params.disable_any_whitespace
    try:
        match params.kind:
            case "json":
                schema = schema_text(params)
                return compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
            case "json_object":
                return compiler.compile_builtin_json_grammar()
            case "regex":
                return compiler.compile_regex(params.regex or "")
            case "choice":
                return compiler.compile_grammar(choice_ebnf(params.choice or []))
            case _:
                return compiler.compile_grammar(params.grammar or "")
    except GrammarError:
        raise
    except Exception as exc:
        raise GrammarError(f"invalid structured_outputs.{params.kind}: {_reason(exc)}") from None
