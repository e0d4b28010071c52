"""Whether an actor traces: ``actor_tracer`` gives it an ``ActorTracer`` when the deployment's
``otlp_traces_endpoint`` is set, else None (and imports nothing of OpenTelemetry).
``check_tracing`` fails early, in the launcher, when tracing is asked for but cannot run."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from shoal.config.observability import ObservabilityConfig
from shoal.tracing.exporter import exporter_class, span_exporter, traces_protocol

if TYPE_CHECKING:
    from shoal.tracing.tracer import ActorTracer

log = logging.getLogger(__name__)


def actor_tracer(config: ObservabilityConfig, kind: str, actor_id: str) -> ActorTracer | None:
    """The tracer of actor ``actor_id`` of ``kind``; None with tracing off."""
    endpoint = config.otlp_traces_endpoint
    if not endpoint:
        return None
    check_tracing(config)
    from shoal.tracing.tracer import open_tracer

    return open_tracer(span_exporter(endpoint), kind, actor_id)


def check_tracing(config: ObservabilityConfig) -> None:
    """``TracingUnavailable`` if ``config`` asks for traces this installation cannot export."""
    if config.otlp_traces_endpoint:
        exporter_class(traces_protocol())  # (the exporters import OpenTelemetry's SDK)


async def close_tracer(tracer: ActorTracer | None, timeout_s: float = 5.0) -> None:
    """Export what ``tracer`` holds and stop it, waiting at most ``timeout_s`` (off the event
    loop: the export is a blocking call; an unreachable collector is given up on)."""
    if tracer is None:
        return
    task = asyncio.ensure_future(asyncio.to_thread(tracer.shutdown))
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        log.warning("traces not all exported within %g s", timeout_s)
