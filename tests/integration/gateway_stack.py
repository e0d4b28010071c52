"""The gateway over the real engine stack (worker, engine core, engine client on an in-memory
bus), for tests that start it once per module, plus bounded waits on its state: the engine core
idle (no requests, every KV block free) and the gateway's accounting settled."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bus.memory import InMemoryBus
from shoal.gateway.app import create_app
from shoal.gateway.metrics import FINISH_REASONS, Metrics
from shoal.gateway.server import start_http_server
from tests.integration.engine_stack import EngineStack, engine_stack
from tests.waiting import wait_for

MODEL_NAME = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def with_chat_template(model_dir: Path, out_dir: Path) -> Path:
    """A copy of the checkpoint at ``out_dir`` whose tokenizer has a chat template."""
    from transformers import AutoTokenizer

    shutil.copytree(model_dir, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = CHAT_TEMPLATE
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
            await wait_for(self.is_idle, timeout_s)
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
async def served_engine(
    model_dir: Path, *, sse_keep_alive_s: float | None = None, **stack_options: Any
) -> AsyncIterator[ServedStack]:
    """The app served on a free port in front of a one-engine stack; ``stack_options`` go to
    ``engine_stack`` (``max_num_seqs``, ``max_model_len``...)."""
    bus = InMemoryBus()
    await bus.connect()
    try:
        async with engine_stack(bus, model_dir, **stack_options) as stack:
            metrics = Metrics(MODEL_NAME, max_model_len=stack.client.max_model_len)
            stack.client.stats_listeners.append(metrics.update_engine_stats)
            options: dict[str, Any] = {}
            if sse_keep_alive_s is not None:
                options["sse_keep_alive_s"] = sse_keep_alive_s
            app = create_app(stack.client, served_model_name=MODEL_NAME, metrics=metrics, **options)
            server = await start_http_server(app)
            try:
                yield ServedStack(server.url, stack, metrics)
            finally:
                await server.stop()
    finally:
        await bus.close()
