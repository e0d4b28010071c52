"""Local single-node mode: the whole deployment on this host, started and stopped as one.

With the NATS bus, an embedded nats-server is started (unless ``--nats-url`` names one to
join) and started again on the same address and store if it dies (every actor's bus reconnects
and resubscribes), the workers and engine cores run as supervised processes (restarted if they
die) and the gateway serves in this process. With the in-memory bus everything is one process.
Status events of every actor are logged, so the log shows each one becoming ready; ``stop`` (set
from SIGINT/SIGTERM) drains the gateway, then stops the actors and the server: no orphans.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from shoal.bus import connect_bus
from shoal.bus.base import Bus
from shoal.bus.codec import Codec, DecodeError
from shoal.bus.messages.control import StatusEvent
from shoal.bus.msg import Msg
from shoal.bus.nats_ops.credentials import NatsCredentials
from shoal.bus.nats_ops.server import NatsServer, keep_running
from shoal.bus.runtime.actor import Actor
from shoal.bus.runtime.supervisor import ActorSpec, ChildEvent, Supervisor
from shoal.bus.subjects import Subjects
from shoal.config.deployment import ShoalConfig
from shoal.deploy.deployment import plan_actors, start_in_process, stop_in_process
from shoal.engine.client.engine_client import AsyncEngineClient
from shoal.gateway.actor import GatewayActor

log = logging.getLogger("shoal")

_STATUS: Codec[StatusEvent] = Codec(StatusEvent)


@dataclass(frozen=True)
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    sse_keep_alive_s: float | None = None  # None: the gateway's default
    shutdown_delay_s: float = 0.0

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> HttpOptions:
        return cls(ns.host, ns.port, ns.api_key, ns.sse_keep_alive_s, ns.shutdown_delay_s)

    def gateway_kwargs(self) -> dict[str, Any]:
        """``GatewayActor`` keyword arguments (its defaults for what is not set here)."""
        kwargs: dict[str, Any] = {"host": self.host, "port": self.port, "api_key": self.api_key}
        kwargs["shutdown_delay_s"] = self.shutdown_delay_s
        if self.sse_keep_alive_s is not None:
            kwargs["sse_keep_alive_s"] = self.sse_keep_alive_s
        return kwargs


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _log_status(msg: Msg) -> None:
    try:
        event = _STATUS.decode(msg.data)
    except DecodeError:
        return
    reason = f" ({event.reason})" if event.reason else ""
    log.info("%s %s is %s%s", event.kind, event.actor_id, event.state.name.lower(), reason)


def _log_level() -> str:
    """The launcher's log level, for the actor processes it starts."""
    return logging.getLevelName(logging.getLogger().getEffectiveLevel())


def _log_child(event: ChildEvent) -> None:
    log.info("process %s: %s (pid %s)", event.name, event.state.value, event.pid)


@contextlib.asynccontextmanager
async def _nats_actors(
    config: ShoalConfig, bus_url: str, bus: Bus, credentials: NatsCredentials | None
) -> AsyncIterator[None]:
    num_engines = config.parallel_config.data_parallel_size
    tp_inits = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(num_engines)]
    # Credentials reach the children through their environment, never their command line.
    env = {"SHOAL_LOG_LEVEL": _log_level(), **(credentials.child_env() if credentials else {})}
    specs = [
        ActorSpec(p.name, p.target, bus_url, p.kwargs, env=env, kind=p.kind)
        for p in plan_actors(
            config,
            tp_init_methods=tp_inits,
            ep_init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
        )
    ]
    namespace = config.bus_config.namespace
    supervisor = Supervisor(specs, on_event=_log_child, status_bus=bus, namespace=namespace)
    async with supervisor:
        yield


@contextlib.asynccontextmanager
async def _memory_actors(config: ShoalConfig, bus: Bus) -> AsyncIterator[None]:
    actors: list[Actor] = await start_in_process(bus, plan_actors(config))
    try:
        yield
    finally:
        await stop_in_process(actors)


def check_embedded_server(config: ShoalConfig) -> None:
    """``ValueError`` if ``config`` asks the embedded nats-server (a single node) for more
    JetStream copies than it can keep (its buckets would fail to open only when first used)."""
    bus = config.bus_config
    if bus.bus == "nats" and not bus.nats_url and bus.jetstream_replicas > 1:
        raise ValueError(
            f"--jetstream-replicas {bus.jetstream_replicas} needs a NATS cluster (--nats-url): "
            "the embedded nats-server is a single node"
        )


@contextlib.asynccontextmanager
async def _bus_url(config: ShoalConfig) -> AsyncIterator[str]:
    bus_config = config.bus_config
    check_embedded_server(config)
    if bus_config.bus == "memory":
        yield "memory://local"
    elif bus_config.nats_url:
        yield bus_config.nats_url
    else:
        server = NatsServer()
        server.start()  # on this thread: the server's PDEATHSIG follows the starting thread
        log.info("embedded nats-server pid %s listening on %s", server.pid, server.url)
        watcher = asyncio.create_task(keep_running(server, on_restart=_log_server_restart))
        try:
            yield server.url
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            server.stop()
            server.cleanup()


def _log_server_restart(server: NatsServer) -> None:
    log.warning("embedded nats-server restarted: pid %s listening on %s", server.pid, server.url)


async def serve_local(
    config: ShoalConfig,
    http: HttpOptions,
    stop: asyncio.Event,
    *,
    ready_timeout_s: float = 600,
    credentials: NatsCredentials | None = None,
) -> None:
    """Run the deployment until ``stop`` is set; ``credentials``: every process's NATS user
    (joining a server with authorization: one user for every role here)."""
    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(_bus_url(config))
        bus = await connect_bus(url, **(credentials.bus_options() if credentials else {}))
        stack.push_async_callback(bus.close)
        await bus.subscribe(Subjects(config.bus_config.namespace).status("*"), _log_status)
        if config.bus_config.bus == "memory":
            await stack.enter_async_context(_memory_actors(config, bus))
        else:
            await stack.enter_async_context(_nats_actors(config, url, bus, credentials))
        client = await AsyncEngineClient(bus, config).start()
        stack.push_async_callback(client.close)
        await _wait_ready(client, config, stop, ready_timeout_s)
        if stop.is_set():
            return
        gateway = GatewayActor(
            bus,
            "gateway-0",
            config=config,
            engine_client=client,
            **http.gateway_kwargs(),
        )
        await gateway.start()
        stack.push_async_callback(gateway.stop)
        assert gateway.http is not None
        log.info("shoal is serving %s on %s", client.model_name, gateway.http.url)
        await stop.wait()
        log.info("shutting down")


async def _wait_ready(
    client: AsyncEngineClient, config: ShoalConfig, stop: asyncio.Event, timeout_s: float
) -> None:
    num_engines = config.parallel_config.data_parallel_size
    waiting = asyncio.create_task(client.wait_until_ready(timeout_s, num_engines))
    stopping = asyncio.create_task(stop.wait())
    done, pending = await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    if waiting in done:
        waiting.result()
