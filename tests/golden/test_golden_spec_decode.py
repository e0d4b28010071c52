"""Golden: with speculative decoding on (n-gram, a draft model, the target as its own draft,
dynamic K), shoal's greedy tokens still equal transformers' token for token, through the real
scheduler and model runner, with one step in flight and with async scheduling, with chunked
prefill, prefix hits and preemption."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures.models import make_prompts
from tests.golden.driver import SchedulerRun, generate_with_scheduler, greedy, make_runner

MAX_NEW = 24
BLOCK = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


def prompts() -> list[list[int]]:
    """Random prompts, and prompts that repeat a pattern (n-gram drafts find matches there;
    the tiny random models also fall into loops of their own)."""
    patterns = make_prompts((3, 5, 7), seed=11)
    return make_prompts((1, 7, 16, 33), seed=3) + [p * 4 for p in patterns]


def run_spec(
    model_dir: Any, spec: dict[str, Any] | None, prompt_list: list[list[int]], **settings: Any
) -> SchedulerRun:
    num_blocks = settings.pop("num_blocks", 256)
    options = {} if spec is None else {"speculative_config": spec}
    runner = make_runner(model_dir, num_blocks=num_blocks, block_size=BLOCK, **options)
    runner.load()
    params = settings.pop("params", [greedy(MAX_NEW)] * len(prompt_list))
    return generate_with_scheduler(
        runner, prompt_list, params, num_blocks=num_blocks, block_size=BLOCK, **settings
    )


def outputs(run: SchedulerRun) -> list[list[int]]:
    return [run.outputs[f"r{i}"] for i in range(len(run.outputs))]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("variant", ["llama", "qwen3_moe"])
def test_ngram_greedy_equals_transformers(variant, async_scheduling, tiny_checkpoint, hf_reference):
    model_dir = tiny_checkpoint(variant)
    run = run_spec(model_dir, NGRAM, prompts(), async_scheduling=async_scheduling)
    assert outputs(run) == hf_reference(model_dir, prompts(), MAX_NEW)
    assert run.stats is not None and run.stats.spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_with_chunked_prefill_prefix_hits_and_preemption(
    async_scheduling, tiny_checkpoint, hf_reference
):
    model_dir = tiny_checkpoint("llama")
    prefix = make_prompts([3 * BLOCK], seed=7)[0]
    prompt_list = [prefix + p for p in prompts()]
    run = run_spec(
        model_dir,
        NGRAM,
        prompt_list,
        num_blocks=40,
        max_num_batched_tokens=24,
        async_scheduling=async_scheduling,
    )
    assert run.partial_prefill_steps > 0 and run.prefix_cache_hits > 0
    assert run.num_preemptions > 0
    assert outputs(run) == hf_reference(model_dir, prompt_list, MAX_NEW)


@pytest.mark.parametrize(
    "extra",
    [
        {
            "num_speculative_tokens": 5,
            "num_speculative_tokens_per_batch_size": [[1, 3, 5], [4, 64, 1]],
        },
        {"num_speculative_tokens": 4, "acceptance_driven_k": True},
    ],
    ids=["table", "acceptance"],
)
def test_dynamic_k_keeps_greedy_outputs(extra, tiny_checkpoint, hf_reference):
    model_dir = tiny_checkpoint("llama")
    run = run_spec(model_dir, {**NGRAM, **extra}, prompts(), async_scheduling=True)
    assert outputs(run) == hf_reference(model_dir, prompts(), MAX_NEW)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_target_as_its_own_draft_has_every_draft_accepted(
    async_scheduling, tiny_checkpoint, hf_reference
):
    model_dir = tiny_checkpoint("llama")
    spec = {"model": str(model_dir), "num_speculative_tokens": 3}
    run = run_spec(model_dir, spec, prompts(), async_scheduling=async_scheduling)
    assert outputs(run) == hf_reference(model_dir, prompts(), MAX_NEW)
    stats = run.stats
    assert stats is not None and stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_a_smaller_draft_model_keeps_greedy_outputs(tiny_checkpoint, hf_reference):
    model_dir = tiny_checkpoint("llama")
    draft_dir = tiny_checkpoint("llama", num_hidden_layers=1, seed=5)
    spec = {"model": str(draft_dir), "num_speculative_tokens": 2}
    run = run_spec(model_dir, spec, prompts(), num_blocks=60, max_num_batched_tokens=24)
    assert outputs(run) == hf_reference(model_dir, prompts(), MAX_NEW)
    stats = run.stats
    assert stats is not None
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_greedy_logprobs_are_the_same_with_speculation(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    params = [greedy(MAX_NEW, logprobs=2)] * len(prompts())
    plain = run_spec(model_dir, None, prompts(), params=params)
    spec = run_spec(model_dir, NGRAM, prompts(), params=params)
    assert outputs(spec) == outputs(plain)

    def rows(run: SchedulerRun) -> dict[str, list[Any]]:
        return {
            rid: [(t, lp) for chunk in chunks
                  for t, lp in zip(chunk.token_ids, chunk.logprobs, strict=True)]
            for rid, chunks in run.logprobs.items()
        }  # fmt: skip

    got, want = rows(spec), rows(plain)
    assert got.keys() == want.keys()
    for rid in want:  # the same tokens; values to fp32 noise (multi-token queries differ)
        assert [t for t, _ in got[rid]] == [t for t, _ in want[rid]]
        for (_, lp_got), (_, lp_want) in zip(got[rid], want[rid], strict=True):
            assert lp_got == pytest.approx(lp_want, abs=1e-4)


def test_seeded_sampling_is_reproducible_with_speculation(tiny_checkpoint):
    from shoal.bus.messages.sampling import SamplingParams

    model_dir = tiny_checkpoint("llama")
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=MAX_NEW, ignore_eos=True)
              for i in range(len(prompts()))]  # fmt: skip
    first = run_spec(model_dir, NGRAM, prompts(), params=params)
    second = run_spec(model_dir, NGRAM, prompts(), params=params)
    assert outputs(first) == outputs(second)
    assert all(len(o) == MAX_NEW for o in outputs(first))
