"""The gateway over a real engine stack (worker, engine core, engine client; in-memory bus), and
a plain-HTTP completions call that reads streamed and whole answers alike: the harness of the
tests that check the gateway against what the engine core did."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from shoal.bus.memory import InMemoryBus
from shoal.gateway.app import create_app
from shoal.gateway.metrics import Metrics
from shoal.gateway.server import start_http_server
from tests.integration.engine_stack import EngineStack, engine_stack


@contextlib.asynccontextmanager
async def served_stack(
    model_dir: Path, *, app_options: dict[str, Any] | None = None, **options: Any
) -> AsyncIterator[tuple[str, EngineStack, Metrics]]:
    """(base url, the stack, the gateway's metrics); ``options`` go to ``engine_stack``,
    ``app_options`` to ``create_app``."""
    bus = InMemoryBus()
    await bus.connect()
    try:
        async with engine_stack(bus, model_dir, **options) as stack:
            metrics = Metrics("tiny", max_model_len=stack.client.max_model_len)
            stack.client.stats_listeners.append(metrics.update_engine_stats)
            app = create_app(
                stack.client, served_model_name="tiny", metrics=metrics, **(app_options or {})
            )
            server = await start_http_server(app)
            try:
                yield server.url, stack, metrics
            finally:
                await server.stop()
    finally:
        await bus.close()


@dataclass
class Completion:
    """One choice of a /v1/completions answer; for a stream, its chunks joined."""

    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    num_chunks: int = 0


async def complete(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Completion:
    """POST ``body`` to /v1/completions (``stream`` as the body says) and read the one choice."""
    out = Completion()
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        if not body.get("stream"):
            _add_choice(out, await response.json())
            return out
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            _add_choice(out, json.loads(line[len("data: ") :]))
    return out


def _add_choice(out: Completion, answer: dict[str, Any]) -> None:
    if answer.get("usage"):
        out.usage = answer["usage"]
    for choice in answer.get("choices") or []:
        out.num_chunks += 1
        out.text += choice.get("text") or ""
        if choice.get("finish_reason") is not None:
            out.finish_reason = choice["finish_reason"]
            out.stop_reason = choice.get("stop_reason")
