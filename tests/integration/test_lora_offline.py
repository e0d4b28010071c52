"""LoRA adapters through the offline ``LLM`` (vLLM's ``lora_request=LoRARequest(name, id,
path)``): a request whose adapter cannot be read fails alone with an error naming it while the
batch it came with completes (with their adapters, equal to transformers with PEFT's), and
structured outputs constrain an adapter's request as they do the base model's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shoal import LLM, LoRARequest, SamplingParams
from shoal.bus.messages.structured import StructuredOutputsParams
from tests.fixtures.lora import build_adapter, hf_lora_greedy
from tests.fixtures.models import make_prompts

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
MAX_TOKENS = 8
REGEX = r"[a-z ]{4,16}\."


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    adapter = build_adapter(model_dir, tmp_path_factory.mktemp("adapters") / "a0", seed=40)
    llm = LLM(
        str(model_dir), dtype="float32", num_gpu_blocks_override=256, max_num_seqs=8,
        enable_lora=True, max_loras=2,
    )  # fmt: skip
    yield llm, model_dir, adapter
    llm.shutdown()


def test_a_bad_adapter_fails_its_request_alone(served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    llm, model_dir, adapter = served
    prompts = make_prompts((9, 14, 6), seed=4)
    good = LoRARequest("a0", 1, str(adapter))
    missing = LoRARequest("gone", 2, str(tmp_path / "gone"))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        lora_request=[good, missing, None],
        use_tqdm=False,
    )
    assert outputs[1].error is not None
    assert "'gone'" in outputs[1].error and "no such adapter folder" in outputs[1].error
    assert outputs[0].error is None and outputs[2].error is None
    assert (
        list(outputs[0].outputs[0].token_ids)
        == hf_lora_greedy(model_dir, adapter, [prompts[0]], MAX_TOKENS)[0]
    )
    assert (
        list(outputs[2].outputs[0].token_ids)
        == hf_lora_greedy(model_dir, None, [prompts[2]], MAX_TOKENS)[0]
    )


def test_structured_outputs_constrain_an_adapters_request(served) -> None:  # type: ignore[no-untyped-def]
    llm, _, adapter = served
    params = SamplingParams(
        temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=REGEX)
    )
    prompt = {"prompt_token_ids": make_prompts((11,), seed=6)[0]}
    with_adapter, base = llm.generate(
        [prompt, prompt], params, lora_request=[LoRARequest("a0", 1, str(adapter)), None],
        use_tqdm=False,
    )  # fmt: skip
    texts = [with_adapter.outputs[0].text, base.outputs[0].text]
    for text in texts:
        assert re.fullmatch(REGEX, text), texts
    assert texts[0] != texts[1]  # the adapter ran under the grammar
