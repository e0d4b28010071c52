"""OpenTelemetry traces across the actors (``--otlp-traces-endpoint``): one trace per request,
from the gateway through the engine client, the engine core (its queue, each step the request
joined and that step's scheduling) and the workers that ran those steps.

Each actor that traces holds its own ``ActorTracer`` (its service name and instance id, its
exporter); the W3C trace context travels in NATS message headers (``traceparent``,
``tracestate``) from the gateway's client to the engine core, and in ``ExecuteStep`` from the
engine core to its workers (a step joins several requests' traces). Off unless the endpoint is
set: then nothing here imports OpenTelemetry and the actors only test for a missing tracer.
"""
