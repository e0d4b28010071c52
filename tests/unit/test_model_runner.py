"""The model runner's step contract: diffs, partial prefills, logprobs, prompt logprobs,
preemption/resume, errors, KV sizing."""

from __future__ import annotations

import pytest
import torch

from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import CachedRequestData, ExecuteStep, NewRequestData
from shoal.kernels import (
    cpu_build,
    cpu_decode_attention,
    cpu_decode_step,
    cpu_decoder_layers,
    ops,
    strip_gemm,
)
from shoal.workers.kv_cache import bytes_per_block
from shoal.workers.model_runner import ModelRunner
from tests.golden.driver import make_runner

BLOCK = 4


@pytest.fixture
def runner(tiny_checkpoint):  # type: ignore[no-untyped-def]
    r = make_runner(tiny_checkpoint("llama"), num_blocks=64, block_size=BLOCK)
    r.load()
    return r


def new(req_id, prompt, blocks, scheduled, **params):  # type: ignore[no-untyped-def]
    sp = SamplingParams(temperature=0.0, **params)
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=sp,
        block_ids=blocks,
        num_computed_tokens=0,
        num_scheduled_tokens=scheduled,
    )


def full_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """Reference: logits at every position of ``prompt`` from a fresh one-request step."""
    hidden_rows = []
    blocks = list(range(40, 40 + -(-len(prompt) // BLOCK)))
    runner._apply_diff(
        ExecuteStep(step_id=99, new_requests=[new("ref", prompt, blocks, len(prompt))])
    )
    inputs = runner.batch.prepare_inputs(["ref"], [len(prompt)])
    with torch.inference_mode():
        hidden_rows = runner._forward(inputs)
        logits = runner.model.compute_logits(hidden_rows)
    runner._apply_diff(ExecuteStep(step_id=100, finished_req_ids=["ref"]))
    return logits


def test_facts_and_kv_sizing(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    per_block = bytes_per_block(
        num_layers=2, block_size=BLOCK, num_kv_heads=2, head_dim=16, dtype=torch.float32
    )
    r = make_runner(
        model_dir, kv_cache_memory_bytes=37 * per_block + 1, block_size=BLOCK, max_model_len=256
    )
    facts = r.load()
    assert facts.num_blocks == 37 and r.kv_cache.k[0].shape == (37, BLOCK, 2, 16)
    assert r.kv_cache.num_bytes == 37 * per_block
    assert facts.max_model_len == 256 and facts.vocab_size == 320 and facts.eos_token_ids == [2]
    with pytest.raises(ValueError, match="exceeds"):
        make_runner(model_dir, num_blocks=8, max_model_len=10**6).load()


def test_partial_prefill_returns_no_token_then_continues(runner):
    prompt = list(range(10, 21))  # 11 tokens in chunks of 8 and 3
    ref = full_logits(runner, prompt)
    first = runner.execute(ExecuteStep(step_id=0, new_requests=[new("a", prompt, [1, 2], 8)]))
    assert first.req_ids == ["a"] and first.sampled_token_ids == [[]]
    second = runner.execute(
        ExecuteStep(
            step_id=1,
            cached_requests=[
                CachedRequestData(
                    req_id="a", new_block_ids=[3], num_computed_tokens=8, num_scheduled_tokens=3
                )
            ],
        )
    )
    assert second.sampled_token_ids == [[int(ref[-1].argmax())]]


def test_result_follows_the_step_batch_order(runner):
    """A decode listed as cached and a prefill chunk listed as new: the result answers in the
    message's batch order (new first), each request with its own token count."""
    prompt = [11, 12, 13, 14, 15]
    t1 = runner.execute(ExecuteStep(step_id=0, new_requests=[new("a", prompt, [1, 2], 5)]))
    ref = full_logits(runner, [*prompt, t1.sampled_token_ids[0][0]])
    decode = CachedRequestData("a", [], num_computed_tokens=5, num_scheduled_tokens=1)
    step = ExecuteStep(
        step_id=1, cached_requests=[decode], new_requests=[new("b", [4, 5, 6, 7, 8, 9], [3, 4], 4)]
    )
    result = runner.execute(step)
    assert result.req_ids == step.batch_order().req_ids == ["b", "a"]
    assert result.sampled_token_ids == [[], [int(ref[-1].argmax())]]


def test_logprobs_and_prompt_logprobs(runner):
    prompt = [5, 17, 99, 120, 7, 8]
    ref = torch.log_softmax(full_logits(runner, prompt), dim=-1)
    step = ExecuteStep(
        step_id=0,
        new_requests=[
            new("a", prompt, [1, 2], 6, logprobs=3, prompt_logprobs=2),
            new("b", [4, 5], [3], 2),
        ],
    )
    result = runner.execute(step)
    sampled = result.sampled_token_ids[0][0]
    lp = result.logprobs[0]
    assert result.logprobs[1] is None and lp is not None
    assert lp.token_ids[0][0] == sampled == int(ref[-1].argmax()) and lp.ranks == [1]
    top3 = torch.topk(ref[-1], 3)
    assert lp.token_ids[0][1:] == top3.indices.tolist()
    assert lp.logprobs[0][1:] == pytest.approx(top3.values.tolist(), abs=1e-5)
    plp = result.prompt_logprobs[0]
    assert plp is not None and result.prompt_logprobs[1] is None
    assert [row[0] for row in plp.token_ids] == prompt[1:]
    expected = [float(ref[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert [row[0] for row in plp.logprobs] == pytest.approx(expected, abs=1e-5)
    assert all(len(row) == 3 for row in plp.token_ids)


def test_preempted_request_resumes_with_its_outputs(runner):
    prompt = [11, 12, 13, 14, 15]
    out = runner.execute(ExecuteStep(step_id=0, new_requests=[new("a", prompt, [1, 2], 5)]))
    t1 = out.sampled_token_ids[0][0]
    out = runner.execute(
        ExecuteStep(
            step_id=1,
            cached_requests=[
                CachedRequestData(
                    req_id="a", new_block_ids=[], num_computed_tokens=5, num_scheduled_tokens=1
                )
            ],
        )
    )
    t2 = out.sampled_token_ids[0][0]
    resumed = NewRequestData(
        req_id="a",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(temperature=0.0),
        block_ids=[7, 8],
        num_computed_tokens=0,
        num_scheduled_tokens=6,
        output_token_ids=[t1],
        resumed=True,
    )
    again = runner.execute(ExecuteStep(step_id=2, preempted_req_ids=["a"], new_requests=[resumed]))
    assert again.sampled_token_ids == [[t2]]
    assert len(runner.batch) == 1


def test_preempted_seeded_request_resumes_its_random_stream(tiny_checkpoint):
    """Preempted after its first token and recomputed, a seeded request samples the tokens it
    would have sampled without the preemption (its generator waited in the request store)."""
    prompt = [11, 12, 13, 14, 15]
    params = SamplingParams(temperature=1.0, seed=21)

    def first_step(runner: ModelRunner) -> int:
        x = NewRequestData("x", prompt, params, [1, 2], 0, len(prompt))
        return runner.execute(ExecuteStep(step_id=0, new_requests=[x])).sampled_token_ids[0][0]

    def decode(runner: ModelRunner, step_id: int, num_computed: int) -> int:
        cached = CachedRequestData("x", [], num_computed, 1)
        step = ExecuteStep(step_id=step_id, cached_requests=[cached])
        return runner.execute(step).sampled_token_ids[0][0]

    straight = make_runner(tiny_checkpoint("llama"), num_blocks=16, block_size=BLOCK)
    straight.load()
    expected = [first_step(straight), decode(straight, 1, 5), decode(straight, 2, 6)]
    runner = make_runner(tiny_checkpoint("llama"), num_blocks=16, block_size=BLOCK)
    runner.load()
    got = [first_step(runner)]
    generator = runner.requests["x"].generator
    resumed = NewRequestData("x", prompt, params, [3, 4], 0, 6, output_token_ids=got, resumed=True)
    step = ExecuteStep(step_id=1, preempted_req_ids=["x"], new_requests=[resumed])
    got += runner.execute(step).sampled_token_ids[0]
    assert runner.requests["x"].generator is generator
    got.append(decode(runner, 2, 6))
    assert got == expected and len(set(expected)) > 1


def test_unknown_cached_request_is_an_error(runner):
    with pytest.raises(KeyError, match="ghost"):
        runner.execute(
            ExecuteStep(
                step_id=0,
                cached_requests=[
                    CachedRequestData(
                        req_id="ghost",
                        new_block_ids=[],
                        num_computed_tokens=3,
                        num_scheduled_tokens=1,
                    )
                ],
            )
        )


def test_empty_step_and_reset(runner):
    assert runner.execute(ExecuteStep(step_id=4)).req_ids == []
    runner.execute(ExecuteStep(step_id=5, new_requests=[new("a", [1, 2, 3], [1], 3)]))
    runner.reset()
    assert len(runner.batch) == 0 and "a" not in runner.requests


def test_step_over_token_budget_is_refused(tiny_checkpoint):
    r = make_runner(
        tiny_checkpoint("llama"), num_blocks=16, block_size=BLOCK, max_num_batched_tokens=4
    )
    r.load()
    with pytest.raises(ValueError, match="max_num_batched_tokens=4"):
        r.execute(ExecuteStep(step_id=0, new_requests=[new("a", [1, 2, 3, 4, 5], [1, 2], 5)]))
    assert r.num_requests == 1  # the diff applied; the engine finishes the request on error


def test_seeded_sampling_independent_of_batch_and_chunking(tiny_checkpoint):
    """A seeded request samples the same tokens alone and inside a chunked, mixed batch: its
    generator advances only on steps where it really samples."""
    from tests.fixtures.models import make_prompts
    from tests.golden.driver import generate_with_scheduler

    model_dir = tiny_checkpoint("qwen2")
    prompts = make_prompts()
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    others = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)] * 7

    def run(batch_prompts, params, budget):  # type: ignore[no-untyped-def]
        runner = make_runner(model_dir, num_blocks=128, block_size=BLOCK)
        runner.load()
        return generate_with_scheduler(
            runner,
            batch_prompts,
            params,
            num_blocks=128,
            block_size=BLOCK,
            max_num_batched_tokens=budget,
        )

    alone = run([prompts[-1]], [seeded], 2048).outputs["r0"]
    mixed = run(prompts, [*others, seeded], 24)
    assert mixed.partial_prefill_steps > 0
    assert mixed.outputs["r7"] == alone and len(alone) == 10


@pytest.mark.skipif(
    cpu_build.load_kernel_library(cpu_decode_attention.LIBRARY) is None,
    reason="no C compiler here: the kernels cannot be built",
)
def test_loading_on_the_cpu_builds_the_c_kernels_before_any_step(tiny_checkpoint, monkeypatch):  # type: ignore[no-untyped-def]
    """A first request must not wait for the compiler: the worker's load builds (or loads from
    the machine's kernel cache) every kernel library. Building itself is the kernel tests'
    (``tests/kernels/test_cpu_decode_attention.py``): here the cache is warm, so the test does
    not compile the libraries a second time."""
    loaded: list[str] = []
    load = cpu_build._load

    def record(name: str):  # type: ignore[no-untyped-def]
        loaded.append(name)
        return load(name)

    cpu_build.load_kernel_library.cache_clear()
    monkeypatch.setattr(cpu_build, "_load", record)
    try:
        make_runner(tiny_checkpoint("llama"), num_blocks=16, block_size=BLOCK).load()
        assert sorted(loaded) == [
            "decoder_layers",
            "layer_pointwise",
            "paged_decode_attention",
            "prefill_attention",
            "strip_gemm",
        ]
    finally:
        cpu_build.load_kernel_library.cache_clear()


def _prefill(runner):  # type: ignore[no-untyped-def]
    """Two prompts' first step: (the step of their two decodes, each request's first token,
    the prompts)."""
    prompts = {"a": [11, 12, 13, 14, 15], "b": [4, 5, 6, 7, 8, 9, 10]}
    first = runner.execute(
        ExecuteStep(
            step_id=0,
            new_requests=[new("a", prompts["a"], [1, 2], 5), new("b", prompts["b"], [3, 4], 7)],
        )
    )
    tokens = dict(zip(first.req_ids, (t[0] for t in first.sampled_token_ids), strict=True))
    decodes = [
        CachedRequestData("a", [], num_computed_tokens=5, num_scheduled_tokens=1),
        CachedRequestData("b", [], num_computed_tokens=7, num_scheduled_tokens=1),
    ]
    return ExecuteStep(step_id=1, cached_requests=decodes), tokens, prompts


def _assert_tokens_of_full_prompts(runner, second, tokens, prompts) -> None:  # type: ignore[no-untyped-def]
    for req_id, sampled in zip(second.req_ids, second.sampled_token_ids, strict=True):
        ref = full_logits(runner, [*prompts[req_id], tokens[req_id]])
        assert sampled == [int(ref[-1].argmax())]


@pytest.mark.skipif(
    cpu_build.load_kernel_library(cpu_decode_attention.LIBRARY) is None,
    reason="no C compiler here: the kernel cannot be built",
)
def test_a_step_of_decodes_runs_every_layer_in_one_kernel_call(runner):
    """Two decodes of a dense model: all its layers in one C call
    (``kernels/cpu_decoder_layers.py``), none through the per-layer calls, the tokens those of
    fresh full prompts."""
    decodes, tokens, prompts = _prefill(runner)
    steps, per_layer = (
        cpu_decoder_layers.decoder_layer_calls(),
        cpu_decode_step.fused_decode_calls(),
    )
    second = runner.execute(decodes)
    assert cpu_decoder_layers.decoder_layer_calls() == steps + 1
    assert cpu_decode_step.fused_decode_calls() == per_layer
    _assert_tokens_of_full_prompts(runner, second, tokens, prompts)


@pytest.mark.skipif(
    cpu_build.load_kernel_library(cpu_decode_attention.LIBRARY) is None,
    reason="no C compiler here: the kernel cannot be built",
)
def test_the_layers_table_is_kept_until_a_weight_or_cache_is_replaced(runner):
    """The one call's table of pointers is made once; a replaced weight or a rebound cache
    makes it again (the old one would point at what the layers no longer hold)."""
    decodes, _, _ = _prefill(runner)
    model = runner.model.model
    runner.execute(decodes)
    table = model._layer_table()
    assert table is not None and model._layer_table() is table
    layer = model.layers[0]
    linear = layer.self_attn.o_proj
    linear.weight = strip_gemm.pack_strips(linear.weight.to_dense().clone())
    replaced = model._layer_table()
    assert replaced is not None and replaced is not table
    assert replaced.parts[0].o_proj is linear.weight
    attention = layer.self_attn.attn
    attention.bind_cache(attention.k_cache.clone(), attention.v_cache.clone())
    rebound = model._layer_table()
    assert rebound is not None and rebound.parts[0].k_cache is attention.k_cache


@pytest.mark.skipif(
    cpu_build.load_kernel_library(cpu_decode_attention.LIBRARY) is None,
    reason="no C compiler here: the kernel cannot be built",
)
@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "mixtral"])
def test_layers_with_biases_qk_norms_or_experts_keep_their_own_calls(variant, tiny_checkpoint):
    """q/k/v biases (Qwen2), per-head q/k norms (Qwen3), sparse MLPs (Mixtral): the layers'
    one call does not serve them, and the step's tokens are still those of full prompts."""
    runner = make_runner(tiny_checkpoint(variant), num_blocks=64, block_size=BLOCK)
    runner.load()
    decodes, tokens, prompts = _prefill(runner)
    steps = cpu_decoder_layers.decoder_layer_calls()
    second = runner.execute(decodes)
    assert cpu_decoder_layers.decoder_layer_calls() == steps
    _assert_tokens_of_full_prompts(runner, second, tokens, prompts)


@pytest.mark.skipif(
    cpu_build.load_kernel_library(cpu_decode_attention.LIBRARY) is None,
    reason="no C compiler here: the kernel cannot be built",
)
def test_without_the_layers_call_each_layer_runs_its_attention_in_one_kernel_call(
    runner, monkeypatch
):  # type: ignore[no-untyped-def]
    """Where the layers' one call does not serve (here refused), each layer's rotary, K/V write
    and attention still run in one C call (``kernels/cpu_decode_step.py``)."""
    monkeypatch.setattr(ops, "plan_decoder_layers", lambda parts, eps: None)
    decodes, tokens, prompts = _prefill(runner)
    steps, per_layer = (
        cpu_decoder_layers.decoder_layer_calls(),
        cpu_decode_step.fused_decode_calls(),
    )
    second = runner.execute(decodes)
    assert cpu_decoder_layers.decoder_layer_calls() == steps
    layers = len(runner.model.model.layers)
    assert cpu_decode_step.fused_decode_calls() == per_layer + layers
    _assert_tokens_of_full_prompts(runner, second, tokens, prompts)
