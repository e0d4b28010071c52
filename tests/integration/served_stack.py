"""The gateway over a real engine stack (worker, engine core, engine client; in-memory bus) as
one ``ServedStack``, with a bounded wait on its state (the engine core idle: no requests, every
KV block free; the gateway's accounting settled: nothing in flight, every completion started
counted as finished); a copy of a checkpoint with a chat template; and a plain-HTTP completions
call that reads streamed and whole answers alike. The harness of the tests that check the gateway
against what the engine core did."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from shoal.bus.transport.memory import InMemoryBus
from shoal.gateway.app import create_app
from shoal.gateway.metrics import FINISH_REASONS, Metrics
from shoal.gateway.server import start_http_server
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import EngineStack, engine_stack

MODEL_NAME = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def with_chat_template(model_dir: Path, out_dir: Path, template: str = CHAT_TEMPLATE) -> Path:
    """A copy of the checkpoint at ``out_dir`` whose tokenizer has a chat template."""
    from transformers import AutoTokenizer

    shutil.copytree(model_dir, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


@dataclass
class ServedStack:
    url: str
    stack: EngineStack
    metrics: Metrics

    @property
    def scheduler(self) -> Any:
        return self.stack.engines[0].core.scheduler  # type: ignore[union-attr]

    def engine_is_idle(self) -> bool:
        """No request left in the engine core and every KV block back in the free pool."""
        scheduler = self.scheduler
        return not scheduler.requests and scheduler.kv_cache_manager.usage == 0.0

    def is_idle(self) -> bool:
        return self.engine_is_idle() and self.accounting_is_settled()

    def accounting_is_settled(self) -> bool:
        return self.metrics.num_in_flight == 0 and self.num_started() == self.num_finished()

    def num_started(self) -> float:
        """Completions the gateway started (the sum of ``n`` over its engine requests)."""
        return self._sample("vllm:request_params_n_sum")

    def num_finished(self) -> float:
        """Completions the gateway counted as finished, over every finish reason."""
        return sum(
            self._sample("vllm:request_success_total", finished_reason=reason)
            for reason in FINISH_REASONS
        )

    def _sample(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, {"model_name": MODEL_NAME, **labels})
        return value or 0.0

    async def wait_until_idle(self, timeout_s: float = 30.0) -> None:
        """Until the engine core is idle and the accounting settled; fails after the bound."""
        try:
            await wait_for(self.is_idle, timeout_s, "engine idle, accounting settled")
        except AssertionError as error:
            raise AssertionError(f"{error}: {self.describe()}") from None

    def describe(self) -> str:
        scheduler = self.scheduler
        return (
            f"engine requests {len(scheduler.requests)}, KV usage "
            f"{scheduler.kv_cache_manager.usage}, gateway in flight {self.metrics.num_in_flight}, "
            f"completions started {self.num_started()}, finished {self.num_finished()}"
        )


@contextlib.asynccontextmanager
async def served_stack(
    model_dir: Path, *, app_options: dict[str, Any] | None = None, **options: Any
) -> AsyncIterator[ServedStack]:
    """The gateway serving ``model_dir`` as ``MODEL_NAME``; ``options`` go to ``engine_stack``
    (``max_num_seqs``, ``max_model_len``...), ``app_options`` to ``create_app``."""
    bus = InMemoryBus()
    await bus.connect()
    try:
        async with engine_stack(bus, model_dir, **options) as stack:
            metrics = Metrics(MODEL_NAME, max_model_len=stack.client.max_model_len)
            stack.client.stats_listeners.append(metrics.update_engine_stats)
            app = create_app(
                stack.client, served_model_name=MODEL_NAME, metrics=metrics, **(app_options or {})
            )
            server = await start_http_server(app)
            try:
                yield ServedStack(server.url, stack, metrics)
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
