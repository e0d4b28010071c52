"""Serving the gateway app on a TCP socket, in-process (local mode) or as its own process.

A client that disconnects cancels its handler (``handler_cancellation``), which closes its
engine iterators and so aborts its requests in the engine cores at once.
"""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

SHUTDOWN_TIMEOUT_S = 10.0


class HttpServer:
    """A started gateway app; ``port`` is the bound port (useful with port 0)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self.runner = runner
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_http_server(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> HttpServer:
    """Bind and start serving; returns once the socket accepts connections."""
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S, access_log=None
    )
    await runner.setup()
    sock = socket.create_server((host, port), reuse_port=False)
    site = web.SockSite(runner, sock)
    await site.start()
    return HttpServer(runner, host, sock.getsockname()[1])


async def serve_forever(app: web.Application, host: str, port: int, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set (the caller wires signals to it), then drain and close."""
    server = await start_http_server(app, host, port)
    try:
        await stop.wait()
    finally:
        await server.stop()
