"""The client's check of a request's grammar (structured outputs) before any engine core sees
it: an invalid JSON schema, regex or grammar is the caller's mistake (``RequestValidationError``:
a 400 on the HTTP API), found off the event loop (the first check imports xgrammar)."""

from __future__ import annotations

import asyncio

from shoal.bus.messages.structured import StructuredOutputsParams
from shoal.engine.client.errors import RequestValidationError
from shoal.engine.structured.grammars import GrammarError, check_grammar


async def check_structured_outputs(params: StructuredOutputsParams) -> None:
    try:
        await asyncio.to_thread(check_grammar, params)
    except GrammarError as exc:
        raise RequestValidationError(str(exc), "structured_outputs") from None
