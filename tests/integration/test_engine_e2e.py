"""End to end through the actors (worker, engine core, engine client) on the in-memory bus and
on a real nats-server: greedy tokens equal transformers', streaming deltas add up, aborts free
blocks, two engine cores share the load."""

from __future__ import annotations

import asyncio

import pytest

from shoal.bus.messages.sampling import OutputKind, SamplingParams
from tests.fixtures.models import hf_greedy, make_prompts
from tests.integration.conditions import (
    CONTEXT_LEN,
    assert_ended_by_abort,
    core_is_settled,
    read_then_hang_up,
    wait_for,
)
from tests.integration.engine_stack import engine_stack

pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 12
NUM_BLOCKS = 256


async def _collect(client, prompt, params, request_id):  # type: ignore[no-untyped-def]
    final = None
    async for output in client.generate(prompt, params, request_id):
        final = output
    return final


async def test_greedy_matches_transformers(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    prompts = make_prompts()
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    bus = await bus_factory()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async with engine_stack(bus, model_dir) as stack:
        finals = await asyncio.gather(
            *(_collect(stack.client, p, params, f"r{i}") for i, p in enumerate(prompts))
        )
    for final, want in zip(finals, expected, strict=True):
        assert final.finished
        assert final.outputs[0].token_ids == want
        assert final.outputs[0].finish_reason == "length"


async def test_streamed_deltas_join_to_the_final_text(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    bus = await bus_factory()
    async with engine_stack(bus, model_dir) as stack:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        full = await _collect(stack.client, "hello world", params, "full")
        delta = SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True, output_kind=OutputKind.DELTA
        )
        pieces, tokens = [], []
        async for out in stack.client.generate("hello world", delta, "delta"):
            pieces.append(out.outputs[0].text)
            tokens.extend(out.outputs[0].token_ids)
    assert "".join(pieces) == full.outputs[0].text
    assert tokens == full.outputs[0].token_ids


async def test_abort_mid_generation_frees_blocks(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    """The victim could only end by abort: no eos, and room for ~1000 more tokens."""
    model_dir = tiny_checkpoint("llama")
    bus = await bus_factory()
    prompt = [5, 6, 7]
    max_tokens = CONTEXT_LEN - len(prompt)
    async with engine_stack(bus, model_dir, num_blocks=NUM_BLOCKS) as stack:
        core = stack.engines[0].core
        assert core is not None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        await read_then_hang_up(stack.client.generate(prompt, params, "victim"))
        await wait_for(lambda: core_is_settled(core), 120, "the victim leaves the core")
        assert_ended_by_abort(core.stats(), num_blocks=NUM_BLOCKS, max_tokens=max_tokens)


async def test_two_engine_cores_share_load(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    bus = await bus_factory()
    async with engine_stack(bus, model_dir, num_engines=2) as stack:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = make_prompts()
        finals = await asyncio.gather(
            *(_collect(stack.client, p, params, f"r{i}") for i, p in enumerate(prompts))
        )
        assert all(f.finished for f in finals)
        steps = [e.core.scheduler.step_id for e in stack.engines]  # type: ignore[union-attr]
    assert all(s > 0 for s in steps), steps
