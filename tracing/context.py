"""The W3C trace context as shoal carries it (pure: no OpenTelemetry): a ``dict`` of the two
W3C headers, ``traceparent`` and ``tracestate``, read from HTTP and NATS headers and written to
NATS headers; whether one asks for its request to be recorded (its sampled flag); and the
context variable through which the gateway hands a request's context to the engine client.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
W3C_HEADERS = (TRACEPARENT, TRACESTATE)

# The trace context of the request being served in this task (set by the gateway's HTTP
# middleware and NATS API for the engine client, which starts its span under it).
incoming_trace: ContextVar[dict[str, str] | None] = ContextVar("incoming_trace", default=None)


def trace_headers(headers: Mapping[str, str] | None) -> dict[str, str] | None:
    """The W3C trace headers among ``headers`` (any case), or None without a ``traceparent``."""
    if not headers:
        return None
    found = {key.lower(): value for key, value in headers.items() if key.lower() in W3C_HEADERS}
    return found if TRACEPARENT in found else None


def is_sampled(headers: Mapping[str, str] | None) -> bool:
    """Whether a carried context asks for its spans to be recorded: a well-formed
    ``traceparent`` (version-traceid-spanid-flags) whose flags have the sampled bit."""
    traceparent = headers.get(TRACEPARENT, "") if headers else ""
    parts = traceparent.split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return False
    try:
        return bool(int(parts[3], 16) & 1) and int(parts[1], 16) != 0 and int(parts[2], 16) != 0
    except ValueError:
        return False
