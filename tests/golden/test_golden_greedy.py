"""Golden: shoal's greedy tokens equal transformers' ``generate()`` token for token, for every
architecture, with 8 prompts of different lengths in one batch (fp32, tiny random models)."""

from __future__ import annotations

import pytest

from tests.fixtures.models import VARIANTS, make_prompts
from tests.golden.driver import generate_by_hand, generate_with_scheduler, greedy, make_runner

MAX_NEW = 12
BLOCK = 4


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_batch_matches_transformers(variant, tiny_checkpoint, hf_reference):
    model_dir = tiny_checkpoint(variant)
    prompts = make_prompts()
    runner = make_runner(model_dir, num_blocks=128, block_size=BLOCK)
    runner.load()
    ours = generate_by_hand(runner, prompts, MAX_NEW, BLOCK)
    assert ours == hf_reference(model_dir, prompts, MAX_NEW)
    assert len(runner.batch) == 0  # finished requests left the persistent batch


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chunked_prefill_through_scheduler(variant, tiny_checkpoint, hf_reference):
    """A 24-token budget splits the longer prompts over several steps (partial prefills)."""
    model_dir = tiny_checkpoint(variant)
    prompts = make_prompts()
    runner = make_runner(model_dir, num_blocks=128, block_size=BLOCK)
    runner.load()
    run = generate_with_scheduler(
        runner,
        prompts,
        [greedy(MAX_NEW)] * len(prompts),
        num_blocks=128,
        block_size=BLOCK,
        max_num_batched_tokens=24,
    )
    assert run.partial_prefill_steps > 0 and run.max_scheduled_tokens <= 24
    expected = hf_reference(model_dir, prompts, MAX_NEW)
    assert [run.outputs[f"r{i}"] for i in range(len(prompts))] == expected


@pytest.mark.parametrize("variant", ["llama", "qwen3_moe"])
def test_prefix_cache_hits(variant, tiny_checkpoint, hf_reference):
    """Prompts sharing a 3-block prefix: later ones reuse the first one's cached blocks."""
    model_dir = tiny_checkpoint(variant)
    prefix = make_prompts([3 * BLOCK], seed=7)[0]
    prompts = make_prompts(prefix=prefix)
    runner = make_runner(model_dir, num_blocks=128, block_size=BLOCK)
    runner.load()
    run = generate_with_scheduler(
        runner,
        prompts,
        [greedy(MAX_NEW)] * len(prompts),
        num_blocks=128,
        block_size=BLOCK,
        max_num_batched_tokens=64,
    )
    assert run.prefix_cache_hits > 0
    expected = hf_reference(model_dir, prompts, MAX_NEW)
    assert [run.outputs[f"r{i}"] for i in range(len(prompts))] == expected


@pytest.mark.parametrize("variant", ["llama", "mixtral"])
def test_preemption_with_tiny_kv_pool(variant, tiny_checkpoint, hf_reference):
    """Too few blocks for every request to grow: some are preempted and recomputed."""
    model_dir = tiny_checkpoint(variant)
    prompts = make_prompts()
    num_blocks = 24
    runner = make_runner(model_dir, num_blocks=num_blocks, block_size=BLOCK)
    runner.load()
    run = generate_with_scheduler(
        runner,
        prompts,
        [greedy(MAX_NEW)] * len(prompts),
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_batched_tokens=64,
    )
    assert run.num_preemptions > 0
    expected = hf_reference(model_dir, prompts, MAX_NEW)
    assert [run.outputs[f"r{i}"] for i in range(len(prompts))] == expected
