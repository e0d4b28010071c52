"""A request's structured-output constraint from the OpenAI-compatible fields, as vLLM reads
them: ``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}}}``, ``"text"``), vLLM's ``structured_outputs``
object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields. At most one
may be given; each mistake is a 400 naming the field. Whether the schema, regex or grammar is
valid is the engine client's check (``engine/structured/grammars.py``)."""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.bus.messages.structured import StructuredOutputsParams
from shoal.gateway.errors import bad_request

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class JsonSchemaFormat(msgspec.Struct):
    """OpenAI's ``response_format.json_schema``."""

    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: str
    json_schema: JsonSchemaFormat | None = None


def structured_outputs_of(request: Any) -> StructuredOutputsParams | None:
    """The constraint a request asks for (None: free output)."""
    given: list[tuple[str, dict[str, Any]]] = []
    response_format: ResponseFormat | None = getattr(request, "response_format", None)
    if response_format is not None and response_format.type != "text":
        given.append(("response_format", _from_response_format(response_format)))
    raw = getattr(request, "structured_outputs", None)
    if raw is not None:
        if not isinstance(raw, dict):
            raise bad_request("structured_outputs must be an object", param="structured_outputs")
        given.append(("structured_outputs", raw))
    for field, key in GUIDED.items():
        value = getattr(request, field, None)
        if value is not None:
            given.append((field, {key: value}))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise bad_request(f"give one output constraint, not several ({names})", param=given[1][0])
    field, fields = given[0]
    try:
        return msgspec.convert(fields, StructuredOutputsParams)
    except (msgspec.ValidationError, ValueError) as exc:
        raise bad_request(f"{field}: {exc}", param=field) from None


def _from_response_format(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.schema is None:
            raise bad_request(
                "response_format json_schema needs json_schema.schema",
                param="response_format",
            )
        return {"json": spec.schema}
    raise bad_request(
        f"response_format type must be text, json_object or json_schema, got "
        f"{response_format.type!r}",
        param="response_format",
    )
