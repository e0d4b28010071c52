"""``served_stack`` seen as one ``ServedStack``, with a bounded wait on its state: the engine core
idle (no requests, every KV block free) and the gateway's accounting settled (nothing in flight,
every completion started counted as finished). Also a copy of a checkpoint with a chat template."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.gateway.metrics import FINISH_REASONS, Metrics
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import EngineStack
from tests.integration.served_stack import served_stack

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
async def served_engine(
    model_dir: Path, *, sse_keep_alive_s: float | None = None, **stack_options: Any
) -> AsyncIterator[ServedStack]:
    """``served_stack`` as a ``ServedStack``; ``stack_options`` go to ``engine_stack``
    (``max_num_seqs``, ``max_model_len``...)."""
    app_options: dict[str, Any] = {}
    if sse_keep_alive_s is not None:
        app_options["sse_keep_alive_s"] = sse_keep_alive_s
    async with served_stack(model_dir, app_options=app_options, **stack_options) as served:
        yield ServedStack(*served)
