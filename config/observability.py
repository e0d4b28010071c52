"""The observability group of the configuration (``ObservabilityConfig``; vLLM's flag):
``otlp_traces_endpoint`` turns OpenTelemetry tracing on in every actor (``shoal.tracing``)."""

from __future__ import annotations

import msgspec

from shoal.config.validation import require


class ObservabilityConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    # where every actor sends its spans (OTLP; gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
    # says http/protobuf); None: no tracing
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        endpoint = self.otlp_traces_endpoint
        require(
            endpoint is None or bool(endpoint.strip()),
            "otlp_traces_endpoint",
            "must be a collector's address such as http://localhost:4317, got an empty string",
        )
