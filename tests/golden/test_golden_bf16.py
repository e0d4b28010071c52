"""Golden in bf16: shoal's greedy tokens against transformers' ``generate()`` in bf16, for every
architecture, with 8 prompts of different lengths in one batch, through the bf16 paths
(oneDNN-packed linears, the C decode kernel where it builds, the sampler on fp32 logits).

Two bf16 implementations round differently (transformers' SDPA rounds the softmax weights to
bf16, the C kernel keeps them in fp32), so a greedy pick may differ where transformers' own top
two logits are within a few bf16 steps. The test holds shoal to equality up to such a tie: each
prompt's tokens equal transformers' until its first difference, and there transformers' logit
of shoal's token is within ``TIE`` of its best (measured: 0 to 0.0625, and fp32 preferred
shoal's pick in 5 of 9 such places); at least 6 of the 8 prompts are equal throughout.
"""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import cpu_build, cpu_decode_attention, ops
from shoal.kernels.cpu_decode_attention import CpuDecodePlan
from shoal.kernels.cpu_prefill_attention import cpu_prefill_available, prefill_attention_calls
from shoal.workers.layers.attention import PagedAttention
from tests.fixtures.models import VARIANTS, hf_greedy, make_prompts
from tests.golden.driver import generate_by_hand, make_runner

MAX_NEW = 10
BLOCK = 4
TIE = 0.125  # bf16 logits: 2 steps at magnitudes 8-16, 4 below 8
MIN_EQUAL_PROMPTS = 6
KERNEL_BUILDS = cpu_build.load_kernel_library(cpu_decode_attention.LIBRARY) is not None
PREFILL_KERNEL = cpu_prefill_available(torch.zeros(1, BLOCK, 1, 64, dtype=torch.bfloat16), 1)


def _first_difference(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)


def _hf_bf16_last_logits(model_dir, tokens: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def _decode_plans_seen(monkeypatch) -> list[object]:  # type: ignore[no-untyped-def]
    """Records the decode plan every attention layer ran with: through its forward, through
    the one call of a layer's step of decodes (``decode_step``), or through the one call of
    all the layers' step (``ops.decoder_layers``)."""
    plans: list[object] = []
    attend, decode_step = PagedAttention.forward, PagedAttention.decode_step
    all_layers = ops.decoder_layers

    def spy(self, q, k, v, meta):  # type: ignore[no-untyped-def]
        out = attend(self, q, k, v, meta)
        plans.append(meta.attention_plan.decode)
        return out

    def spy_step(self, qkv, step):  # type: ignore[no-untyped-def]
        plans.append(step.plan)
        return decode_step(self, qkv, step)

    def spy_layers(x, table, step, qkv, scale):  # type: ignore[no-untyped-def]
        out = all_layers(x, table, step, qkv, scale)
        plans.extend([step.plan] * len(table.parts))
        return out

    monkeypatch.setattr(PagedAttention, "__call__", spy)  # (a layer's call is its forward)
    monkeypatch.setattr(ops, "decoder_layers", spy_layers)
    monkeypatch.setattr(PagedAttention, "decode_step", spy_step)
    return plans


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bf16_greedy_equals_transformers_in_bf16_up_to_ties(variant, tiny_checkpoint, monkeypatch):
    model_dir = tiny_checkpoint(variant)
    prompts = make_prompts()
    runner = make_runner(model_dir, dtype="bfloat16", num_blocks=128, block_size=BLOCK)
    runner.load()
    assert runner.dtype == torch.bfloat16
    plans = _decode_plans_seen(monkeypatch)
    ours = generate_by_hand(runner, prompts, MAX_NEW, BLOCK)
    _assert_equal_up_to_ties(model_dir, prompts, ours)
    if KERNEL_BUILDS:
        assert sum(isinstance(p, CpuDecodePlan) for p in plans) >= MAX_NEW - 1


@pytest.mark.skipif(not PREFILL_KERNEL, reason="no AMX-BF16 here: the prompts go to SDPA")
def test_prompts_through_the_amx_prefill_kernel_equal_transformers_in_bf16_up_to_ties(
    tiny_checkpoint,
):
    """A model whose heads the AMX prefill kernel takes (64 features, 3 query heads a kv head,
    as SmolLM2's): prompts of 9-300 tokens, every one's attention in the kernel (counted), one
    past a 64-query work item and one past a 512-key block after its first chunk."""
    model_dir = tiny_checkpoint(
        "llama", hidden_size=192, head_dim=64, num_attention_heads=6, num_key_value_heads=2
    )
    prompts = make_prompts((9, 16, 40, 64, 65, 130, 200, 300))
    runner = make_runner(model_dir, dtype="bfloat16", num_blocks=512, block_size=BLOCK)
    runner.load()
    before = prefill_attention_calls()
    ours = generate_by_hand(runner, prompts, MAX_NEW, BLOCK)
    assert prefill_attention_calls() - before >= 2  # the prompts' step, in each of the 2 layers
    _assert_equal_up_to_ties(model_dir, prompts, ours)


@pytest.mark.skipif(
    not cpu_decode_attention.decode_matrix_units_ready(),
    reason="no AMX here: bf16 decodes run on the vector path",
)
def test_decodes_on_the_matrix_units_equal_transformers_in_bf16_up_to_ties(tiny_checkpoint):
    """Pages of 16 keys and SmolLM2's head shape: every decode step's attention scores its
    16-key tiles on the matrix units (counted: a call per layer per step), prompts ending
    inside a tile, on its edge and past several."""
    model_dir = tiny_checkpoint(
        "llama", hidden_size=192, head_dim=64, num_attention_heads=6, num_key_value_heads=2
    )
    prompts = make_prompts((5, 9, 16, 31, 40, 64, 70, 129))
    runner = make_runner(model_dir, dtype="bfloat16", num_blocks=256, block_size=16)
    runner.load()
    before = cpu_decode_attention.decode_matrix_calls()
    ours = generate_by_hand(runner, prompts, MAX_NEW, 16)
    assert cpu_decode_attention.decode_matrix_calls() - before >= 2 * (MAX_NEW - 1)
    _assert_equal_up_to_ties(model_dir, prompts, ours)


def _assert_equal_up_to_ties(model_dir, prompts, ours) -> None:  # type: ignore[no-untyped-def]
    """Each prompt's tokens equal transformers' in bf16 until its first difference, where
    transformers' logit of ours is within TIE of its best; most prompts equal throughout."""
    theirs = hf_greedy(model_dir, prompts, MAX_NEW, dtype=torch.bfloat16)
    equal = 0
    for prompt, mine, reference in zip(prompts, ours, theirs, strict=True):
        at = _first_difference(mine, reference)
        if at is None:
            equal += 1
            continue
        logits = _hf_bf16_last_logits(model_dir, prompt + mine[:at])
        assert float(logits.max() - logits[mine[at]]) <= TIE, (prompt, at, mine, reference)
    assert equal >= MIN_EQUAL_PROMPTS, (ours, theirs)
