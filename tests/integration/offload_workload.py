"""The workload of the offload tests: conversations whose first turns a worker pool too small
for them evicts before they return, and the offload options that keep their prefixes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.fixtures.models import make_prompts
from tests.integration.async_workload import complete, greedy

BLOCK_SIZE = 16
NUM_BLOCKS = 24  # 23 usable, about two conversations: the others' prefixes are evicted
FIRST_TURNS = make_prompts((150, 140, 160, 130), seed=7)
MAX_TOKENS = 6
Turns = list[list[int]]


def offload_options(
    tmp_path: Path | None = None, cpu_bytes: int = 4 << 20, **more: Any
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config``: a CPU tier, a filesystem tier under ``tmp_path`` if given,
    and ``more`` extra-config keys."""
    extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes, **more}
    if tmp_path is not None:
        extra["secondary_tiers"] = [{"type": "fs", "path": str(tmp_path), "bytes_to_use": 64 << 20}]
    return {
        "kv_transfer_config": {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    }


async def first_turns(client: Any, tag: str = "") -> Turns:
    """Each first turn alone, one after the other (each evicts the one two before it)."""
    outputs = []
    for i, prompt in enumerate(FIRST_TURNS):
        final = await complete(client, prompt, greedy(MAX_TOKENS), f"t1-{i}{tag}")
        outputs.append(list(final.outputs[0].token_ids))
    return outputs


async def second_turns(client: Any, answers: Turns, tag: str = "", **params: Any) -> Turns:
    """Each conversation returns, one after the other (``params``: more sampling params)."""
    outputs = []
    for i, answer in enumerate(answers):
        sampling = greedy(MAX_TOKENS, **params)
        final = await complete(client, follow_up(i, answer), sampling, f"t2-{i}{tag}")
        outputs.append(list(final.outputs[0].token_ids))
    return outputs


def follow_up(index: int, answer: list[int]) -> list[int]:
    """Conversation ``index`` returns: its first turn, the answer and a few new tokens."""
    return [*FIRST_TURNS[index], *answer, 40 + index, 41, 42, 43, 44]


async def conversations(client: Any, tag: str = "") -> Turns:
    answers = await first_turns(client, tag)
    return answers + await second_turns(client, answers, tag)
