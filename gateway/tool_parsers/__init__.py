"""Tool-call parsers by ``--tool-call-parser`` name (vLLM's names), each a small pure module
over the shared ``stream`` machinery; ``forced`` handles ``tool_choice`` required / named."""

from __future__ import annotations

from shoal.gateway.tool_parsers.hermes import HERMES
from shoal.gateway.tool_parsers.llama3_json import LLAMA3_JSON
from shoal.gateway.tool_parsers.mistral import MISTRAL
from shoal.gateway.tool_parsers.stream import CallFormat

TOOL_CALL_FORMATS: dict[str, CallFormat] = {
    "hermes": HERMES,
    "llama3_json": LLAMA3_JSON,
    "mistral": MISTRAL,
}
