"""Golden for half precision: shoal's last-position logits after a batched prefill, in bf16 and
fp16, stay within a stated tolerance of transformers in fp32 (and in bf16 of transformers in
bf16).

Stated tolerances (tiny models, logits within about ±11): bf16 vs HF fp32 mean |Δ| ≤ 0.15 and
max |Δ| ≤ 1.25 (the weights themselves are rounded to bf16); bf16 vs HF bf16 max |Δ| ≤ 0.35;
fp16 vs HF fp32 max |Δ| ≤ 0.3 on at least 7 of the 8 prompts and mean |Δ| ≤ 0.05 (in MoE
models a near-tie in the router can pick another expert for one token in half precision).
"""

from __future__ import annotations

import pytest
import torch

from shoal.bus.messages.worker import ExecuteStep, NewRequestData
from tests.fixtures.models import VARIANTS, make_prompts
from tests.golden.driver import greedy, make_runner

BLOCK = 4


def shoal_last_logits(model_dir, dtype, prompts):  # type: ignore[no-untyped-def]
    runner = make_runner(model_dir, dtype=dtype, num_blocks=128, block_size=BLOCK)
    runner.load()
    new, next_block = [], 1
    for i, prompt in enumerate(prompts):
        count = -(-len(prompt) // BLOCK)
        new.append(
            NewRequestData(
                req_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling_params=greedy(1),
                block_ids=list(range(next_block, next_block + count)),
                num_computed_tokens=0,
                num_scheduled_tokens=len(prompt),
            )
        )
        next_block += count
    runner._apply_diff(ExecuteStep(step_id=0, new_requests=new))
    inputs = runner.batch.prepare_inputs([r.req_id for r in new], [len(p) for p in prompts])
    logits = runner.forward_only(inputs)  # [8, vocab] fp32
    assert logits.dtype == torch.float32
    assert runner.model.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    return logits


def hf_last_logits(model_dir, dtype, prompts):  # type: ignore[no-untyped-def]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p])).logits[0, -1].float() for p in prompts])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bf16_logits_within_tolerance(variant, tiny_checkpoint):
    model_dir = tiny_checkpoint(variant)
    prompts = make_prompts()
    ours = shoal_last_logits(model_dir, "bfloat16", prompts)
    ref32 = hf_last_logits(model_dir, torch.float32, prompts)
    ref16 = hf_last_logits(model_dir, torch.bfloat16, prompts)
    assert (ours - ref32).abs().mean() <= 0.15
    assert (ours - ref32).abs().max() <= 1.25
    assert (ours - ref16).abs().max() <= 0.35


@pytest.mark.parametrize("variant", ["llama", "qwen2_moe"])
def test_fp16_logits_within_tolerance(variant, tiny_checkpoint):
    model_dir = tiny_checkpoint(variant)
    prompts = make_prompts()
    ours = shoal_last_logits(model_dir, "float16", prompts)
    ref32 = hf_last_logits(model_dir, torch.float32, prompts)
    row_max = (ours - ref32).abs().amax(dim=-1)  # [8]
    assert int((row_max <= 0.3).sum()) >= 7, row_max
    assert (ours - ref32).abs().mean() <= 0.05
