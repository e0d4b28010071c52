"""The gateway as an actor: the HTTP server, the public NATS API and the engine-stats feed of
``/metrics`` (and of the periodic stats log, when the deployment speculates), started and
drained together. Several may run at once behind a load balancer (the
NATS API is a queue group); in local mode it runs as a task beside the other actors.

As a process (``shoal actor gateway``), it builds its own engine client from the deployment's
config with ``engine_factory`` (by default ``AsyncEngineClient`` over the bus).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from shoal.bus.base import Bus
from shoal.bus.codec import Codec
from shoal.bus.messages.control import Heartbeat
from shoal.bus.messages.engine import EngineStats, SchedulerStats
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import Actor, Inbox
from shoal.config.deployment import ShoalConfig
from shoal.engine.client.interface import EngineClientInterface
from shoal.engine.client.model_info import is_matryoshka, read_num_layers
from shoal.gateway.app import create_app
from shoal.gateway.embedding_options import EmbeddingOptions
from shoal.gateway.lora_adapters import LoRAAdapters
from shoal.gateway.metrics import Metrics
from shoal.gateway.nats_api import NatsApi
from shoal.gateway.response_store import ResponseStore
from shoal.gateway.server import HttpServer, start_http_server
from shoal.gateway.serving import CONTEXT_KEY, DEFAULT_SSE_KEEP_ALIVE_S, ServingContext
from shoal.gateway.stats_logging import StatsLogger
from shoal.gateway.tools import ToolCallingOptions
from shoal.tracing.setup import actor_tracer, close_tracer

if TYPE_CHECKING:
    from shoal.tracing.tracer import ActorTracer

log = logging.getLogger(__name__)
_HEARTBEAT: Codec[Heartbeat] = Codec(Heartbeat)
DEFAULT_ENGINE_FACTORY = "shoal.engine.client.engine_client:make_client"
ENGINE_DISCOVERY_BEATS = 3  # heartbeat intervals a new gateway listens for engine cores


def load_engine_factory(target: str) -> Any:
    """``"package.module:callable"`` → the callable that builds the engine client."""
    module_name, _, name = target.partition(":")
    if not name:
        raise ValueError(f"engine factory must look like 'module:callable', got {target!r}")
    return getattr(importlib.import_module(module_name), name)


class GatewayActor(Actor):
    """Serves HTTP on ``host:port`` and the NATS API, for one engine client.

    ``/metrics`` gets engine-core figures from the client's ``stats_listeners`` when it has
    them (``AsyncEngineClient`` does), else from the engine stats subject.

    Give ``engine_client`` (in-process), or the deployment's ``config``: the client is then
    built as ``engine_factory(bus, config)`` (``"module:callable"``, may be async).
    """

    kind = "gateway"

    def __init__(
        self,
        bus: Bus,
        actor_id: str,
        *,
        config: ShoalConfig | None = None,
        engine_client: EngineClientInterface | None = None,
        engine_factory: str = DEFAULT_ENGINE_FACTORY,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
        enable_nats_api: bool = True,
        sse_keep_alive_s: float | None = DEFAULT_SSE_KEEP_ALIVE_S,
        shutdown_delay_s: float = 0.0,
        **actor_options: Any,
    ) -> None:
        if engine_client is None and config is None:
            raise ValueError("give engine_client or the deployment's config")
        if config is not None:  # the deployment's namespace, whatever else was passed
            actor_options["namespace"] = config.bus_config.namespace
        super().__init__(bus, actor_id, **actor_options)
        self.engine: EngineClientInterface | None = engine_client
        self.owns_engine = engine_client is None
        self.config = config
        self.engine_factory = engine_factory
        self.host, self.port = host, port
        self.api_key = api_key
        self.enable_nats_api = enable_nats_api
        self.sse_keep_alive_s = sse_keep_alive_s
        self.shutdown_delay_s = shutdown_delay_s
        self.metrics: Metrics | None = None
        self.stats_logger: StatsLogger | None = None
        self.http: HttpServer | None = None
        self.context: ServingContext | None = None
        self.nats_api: NatsApi | None = None
        self.tracer: ActorTracer | None = None  # with --otlp-traces-endpoint
        self._stats_codec = Codec(EngineStats)

    def inboxes(self) -> Sequence[Inbox]:
        tiers = Inbox(self.subjects.heartbeat("tier"), self._on_tier_heartbeat, _HEARTBEAT)
        if self._engine_reports_stats():
            return [tiers]  # the engine client passes engine stats on (see on_start)
        engines = Inbox(self.subjects.engine_stats("*"), self._on_engine_stats, self._stats_codec)
        return [engines, tiers]

    async def _on_tier_heartbeat(self, beat: Heartbeat, msg: Msg) -> None:
        """A KV offload tier's counters: to ``/metrics``."""
        if self.metrics is not None:
            self.metrics.tiering.update_tier(beat)

    def _engine_reports_stats(self) -> bool:
        return isinstance(getattr(self.engine, "stats_listeners", None), list)

    async def _on_engine_stats(self, stats: EngineStats, msg: Msg) -> None:
        self.on_stats(stats.stats, stats.engine_id)

    def on_stats(self, stats: SchedulerStats, engine_id: str) -> None:
        """An engine core's report: to ``/metrics`` and the stats log."""
        if self.metrics is not None:
            self.metrics.update_engine_stats(stats, engine_id)
        if self.stats_logger is not None:
            self.stats_logger.observe(stats, engine_id)

    async def on_start(self) -> None:
        if self.config is not None:
            observability = self.config.observability_config
            self.tracer = actor_tracer(observability, self.kind, self.actor_id)
        engine = self.engine
        if engine is None:
            built = load_engine_factory(self.engine_factory)(self.bus, self.config)
            engine = await built if inspect.isawaitable(built) else built
            self.engine = engine
        name = engine.model_name
        k = self._num_speculative_tokens()
        self.metrics = Metrics(name, max_model_len=engine.max_model_len, num_speculative_tokens=k)
        self.stats_logger = StatsLogger() if k > 0 else None
        if self._engine_reports_stats():
            cast(Any, engine).stats_listeners.append(self.on_stats)
        loras = await self._lora_adapters(name)
        await self._hear_engine_cores(engine)
        bus, responses_bucket = self.bus, self.subjects.responses_bucket()
        app = create_app(
            engine,
            served_model_name=name,
            api_key=self.api_key,
            metrics=self.metrics,
            sse_keep_alive_s=self.sse_keep_alive_s,
            tool_calling=self._tool_calling(),
            trust_request_chat_template=self._trusts_request_chat_templates(),
            loras=loras,
            reasoning_parser=self.config.model_config.reasoning_parser if self.config else None,
            structured_in_reasoning=self._structured_in_reasoning(),
            embeddings=self._embeddings(),
            responses=ResponseStore(lambda: bus.open_kv(responses_bucket)),
            tracer=self.tracer,
        )
        self.context = app[CONTEXT_KEY]
        self.http = await start_http_server(app, self.host, self.port)
        if self.enable_nats_api:
            self.nats_api = NatsApi(
                self.bus, self.context, subjects=self.subjects, tracer=self.tracer
            )
            await self.nats_api.start()
        log.info("%r: serving HTTP on %s", self, self.http.url)

    async def _hear_engine_cores(self, engine: EngineClientInterface) -> None:
        """Open the port once the engine client would take a request, or after a few heartbeat
        intervals: a gateway (re)started beside running engine cores knows none of them until
        their next heartbeats, and would refuse a request in between; with none heard by then
        they are still starting, and ``/health`` says so."""
        deadline = time.monotonic() + ENGINE_DISCOVERY_BEATS * self.heartbeat_interval_s
        while not engine.accepts_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def _lora_adapters(self, served_model_name: str) -> LoRAAdapters:
        """The deployment's LoRA adapters (``--enable-lora``, ``--lora-modules``), shared by
        the HTTP and NATS APIs so an adapter loaded through one serves on both."""
        if self.config is None:
            return LoRAAdapters()
        bus, bucket = self.bus, self.subjects.lora_bucket()
        loras = LoRAAdapters(
            self.config.lora_config,
            served_model_name,
            read_num_layers(self.config.model_config.model),
            open_store=lambda: bus.open_object_store(bucket),
        )
        await loras.load_modules()
        return loras

    def _embeddings(self) -> EmbeddingOptions | None:
        """With ``--runner pooling``: how /v1/embeddings answers (None: it refuses)."""
        if self.config is None or not self.config.model_config.is_pooling:
            return None
        return EmbeddingOptions(matryoshka=is_matryoshka(Path(self.config.model_config.model)))

    def _tool_calling(self) -> ToolCallingOptions:
        """The deployment's tool-calling flags (none without a config)."""
        if self.config is None:
            return ToolCallingOptions()
        model = self.config.model_config
        return ToolCallingOptions(model.enable_auto_tool_choice, model.tool_call_parser)

    def _structured_in_reasoning(self) -> bool:
        """The deployment's ``--structured-outputs-config`` ``enable_in_reasoning``."""
        return self.config is not None and self.config.model_config.structured_in_reasoning

    def _trusts_request_chat_templates(self) -> bool:
        """The deployment's ``--trust-request-chat-template`` (off without a config)."""
        return self.config is not None and self.config.model_config.trust_request_chat_template

    def _num_speculative_tokens(self) -> int:
        """The deployment's K (0: it does not speculate, or this actor has no config)."""
        spec = self.config.speculative_config if self.config is not None else None
        return spec.num_speculative_tokens if spec is not None and spec.enabled else 0

    async def on_stop(self) -> None:
        if self.context is not None:  # out of its load balancer before its port closes
            self.context.draining = True
            await asyncio.sleep(self.shutdown_delay_s)
        if self.nats_api is not None:
            await self.nats_api.stop()
        if self.http is not None:
            await self.http.stop()  # lets running responses finish, up to the shutdown timeout
        if self.metrics is not None and self._engine_reports_stats():
            listeners = cast(Any, self.engine).stats_listeners
            if self.on_stats in listeners:
                listeners.remove(self.on_stats)
        if self.engine is not None and self.owns_engine:
            close = getattr(self.engine, "close", None)
            if close is not None:
                result = close()
                if inspect.isawaitable(result):
                    await result
        tracer, self.tracer = self.tracer, None
        await close_tracer(tracer)

    def load(self) -> dict[str, float]:
        if self.metrics is None:
            return {}
        return {"requests_in_flight": float(self.metrics.num_in_flight)}
