"""Embeddings (``LLM.embed``, the pooling runner) equal transformers' pooled hidden states
(``AutoModel``'s last hidden state: LAST, MEAN or CLS, normalized or not) within 1e-5, on Llama
and Qwen2, with prompts longer than the step's token budget (pooled across prefill chunks);
the same prompt twice gives the same vector (a pooling request never takes a prefix-cache hit,
which would leave tokens out of its mean); a sentence-transformers model's declared pooling is
the default."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shoal import LLM
from tests.fixtures.models import make_prompts

pytestmark = pytest.mark.slow
PROMPTS = make_prompts((5, 17, 9, 23), seed=3)  # 17 and 23 tokens: over one step's budget


def hf_pooled(model_dir: Path, prompt: list[int], kind: str, normalize: bool) -> torch.Tensor:
    import transformers

    model = transformers.AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def embeddings(model_dir: Path, prompts: list[list[int]], **options: object) -> list[torch.Tensor]:
    with LLM(
        str(model_dir), runner="pooling", dtype="float32", block_size=4,
        max_num_batched_tokens=8, **options,
    ) as llm:  # fmt: skip
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    return [torch.tensor(o.outputs.embedding) for o in outputs]


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
@pytest.mark.parametrize(("kind", "normalize"), [("LAST", True), ("MEAN", True), ("CLS", False)])
def test_embeddings_equal_transformers_pooled_states(tiny_checkpoint, variant, kind, normalize):  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint(variant)
    pooler = {"pooling_type": kind, "normalize": normalize}
    got = embeddings(model_dir, [*PROMPTS, PROMPTS[1]], pooler_config=pooler)
    for prompt, vector in zip(PROMPTS, got, strict=False):
        expected = hf_pooled(model_dir, prompt, kind, normalize)
        torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[-1], got[1], atol=1e-5, rtol=1e-5)  # the repeat: no cache hit


def test_a_sentence_transformers_models_pooling_is_the_default(tiny_checkpoint, tmp_path):  # type: ignore[no-untyped-def]
    model_dir = tmp_path / "st"
    shutil.copytree(tiny_checkpoint("llama"), model_dir)
    st = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"},
    ]
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False})
    )
    (vector,) = embeddings(model_dir, PROMPTS[1:2])
    expected = hf_pooled(model_dir, PROMPTS[1], "MEAN", True)
    torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-5)
