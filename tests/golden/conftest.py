"""Golden-test helpers: the prompts, and transformers' greedy reference (computed once per
variant and prompt set, one prompt at a time so no padding is involved)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

PROMPT_LENGTHS = (1, 3, 7, 15, 16, 17, 33, 50)


def make_prompts(lengths=PROMPT_LENGTHS, seed: int = 1, prefix: list[int] | None = None):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 320, (n,), generator=gen).tolist() for n in lengths]
    return [(prefix or []) + p for p in prompts]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # the runner is told to ignore eos as well
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="session")
def hf_reference() -> Callable[[Path, list[list[int]], int], list[list[int]]]:
    cache: dict[tuple, list[list[int]]] = {}

    def get(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        key = (str(model_dir), tuple(map(tuple, prompts)), max_new_tokens)
        if key not in cache:
            cache[key] = hf_greedy(model_dir, prompts, max_new_tokens)
        return cache[key]

    return get
