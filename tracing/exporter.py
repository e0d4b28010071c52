"""Where an actor's spans go: an OTLP exporter for ``--otlp-traces-endpoint``, over the protocol
OpenTelemetry's environment names (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else
``OTEL_EXPORTER_OTLP_PROTOCOL``): ``grpc`` by default, as vLLM's (the endpoint is the
collector's gRPC address, e.g. ``http://collector:4317``), or ``http/protobuf`` (the endpoint is
the full URL, e.g. ``http://collector:4318/v1/traces``). The exporters' other settings
(headers, timeout, TLS) come from the same environment, as OpenTelemetry documents them.
"""

from __future__ import annotations

import os
from typing import Any

PROTOCOLS = ("grpc", "http/protobuf")
INSTALL_HINT = "pip install 'shoal[tracing]'"


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but cannot run here (a package missing, an unknown protocol)."""


def traces_protocol() -> str:
    """The OTLP protocol the environment asks for (``grpc`` unless it says otherwise)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    if protocol not in PROTOCOLS:
        raise TracingUnavailable(
            f"OTLP protocol {protocol!r} is not supported: use one of {', '.join(PROTOCOLS)}"
        )
    return protocol


def exporter_class(protocol: str) -> Any:
    """The OTLP span exporter class of ``protocol`` (``TracingUnavailable`` if not installed)."""
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            return GrpcExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter
    except ImportError as exc:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint ({protocol}) needs OpenTelemetry's SDK and OTLP exporter: "
            f"{INSTALL_HINT} ({exc.name or exc} is missing)"
        ) from None


def span_exporter(endpoint: str) -> Any:
    """An OTLP span exporter to ``endpoint`` over ``traces_protocol()``."""
    return exporter_class(traces_protocol())(endpoint=endpoint)
