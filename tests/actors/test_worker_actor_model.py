"""The worker actor over a real model runner and a tiny random Llama, on the in-memory bus:
greedy tokens through the bus equal transformers' ``generate``; bad steps get a StepError."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from shoal.bus.codec import Codec
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import (
    CachedRequestData,
    DescribeWorker,
    ExecuteStep,
    NewRequestData,
    StepResult,
    WorkerInfo,
    WorkerOutbound,
)
from shoal.bus.runtime.actor import call
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.config.deployment import ShoalConfig
from shoal.workers.actor import WorkerActor

pytest.importorskip("transformers")

REPLY = Codec(WorkerOutbound)
PROMPTS = [[5, 17, 42, 9, 100, 7], [11, 3, 250, 64]]
NUM_TOKENS = 4
BLOCK_SIZE = 16


def _hf_greedy(model_dir: Path, prompt: list[int], num_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    generated = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
    )
    return generated[0, len(prompt) :].tolist()


class Engine:
    """The engine core's side of the conversation, by hand."""

    def __init__(self, bus: InMemoryBus, subject: str) -> None:
        self.bus = bus
        self.subject = subject

    async def ask(self, message: object) -> object:
        return await call(self.bus, self.subject, message, REPLY, timeout=60.0)

    async def step(self, message: ExecuteStep) -> StepResult:
        result = await self.ask(message)
        assert isinstance(result, StepResult)
        return result


@pytest.fixture
async def served(tiny_checkpoint: Callable[..., Path]) -> AsyncIterator[tuple[Engine, Path]]:
    model_dir = tiny_checkpoint("llama")
    broker = InMemoryBroker()
    actor = WorkerActor(
        InMemoryBus(broker),
        "w0",
        config=ShoalConfig.from_options(
            model=str(model_dir),
            num_gpu_blocks_override=16,
            block_size=BLOCK_SIZE,
            max_num_seqs=4,
        ),
        heartbeat_interval_s=0.05,
    )
    engine_bus = InMemoryBus(broker)
    await engine_bus.connect()
    await actor.start()
    yield Engine(engine_bus, actor.subjects.worker_in("w0")), model_dir
    await actor.stop()
    await actor.bus.close()
    await engine_bus.close()


def _new(i: int, prompt: list[int], params: SamplingParams) -> NewRequestData:
    blocks = [1 + 2 * i, 2 + 2 * i]
    return NewRequestData(f"r{i}", prompt, params, blocks, 0, len(prompt), eos_token_ids=[2])


async def test_greedy_tokens_through_the_bus_match_transformers(
    served: tuple[Engine, Path],
) -> None:
    engine, model_dir = served
    info = await engine.ask(DescribeWorker("e0"))
    assert isinstance(info, WorkerInfo)
    assert (info.num_blocks, info.block_size, info.eos_token_ids) == (16, BLOCK_SIZE, [2])
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, logprobs=2)
    first = await engine.step(
        ExecuteStep(0, new_requests=[_new(i, p, greedy) for i, p in enumerate(PROMPTS)])
    )
    assert first.error is None, first.error
    outputs = [list(tokens) for tokens in first.sampled_token_ids]
    for step_id in range(1, NUM_TOKENS):
        cached = [
            CachedRequestData(f"r{i}", [], len(p) + len(outputs[i]) - 1, 1)
            for i, p in enumerate(PROMPTS)
        ]
        result = await engine.step(ExecuteStep(step_id, cached_requests=cached))
        assert result.error is None, result.error
        assert len(result.logprobs) == len(PROMPTS)
        for i, tokens in enumerate(result.sampled_token_ids):
            outputs[i] += tokens
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output == _hf_greedy(model_dir, prompt, NUM_TOKENS)


async def test_a_bad_step_is_answered_with_a_step_error(served: tuple[Engine, Path]) -> None:
    engine, _ = served
    unknown = CachedRequestData("ghost", [], 3, 1)
    result = await engine.step(ExecuteStep(0, cached_requests=[unknown]))
    assert result.error is not None
    assert result.error.req_ids == ["ghost"]
    assert "ghost" in result.error.message and "KeyError" in result.error.message
    ok = await engine.step(
        ExecuteStep(1, new_requests=[_new(0, PROMPTS[0], SamplingParams(seed=3))])
    )
    assert ok.error is None and len(ok.sampled_token_ids[0]) == 1
