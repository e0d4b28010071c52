"""bench/peers.py's shoal worker: the offline ``LLM`` of this checkout (the repository two
folders up, put first on ``sys.path``) on the bench's Hugging Face directory, driven by
``worker_loop``. Run by path in shoal's interpreter: ``python shoal_worker.py CONFIG FD``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from worker_loop import Handler, Measures, Reply, main  # noqa: E402


def load(config: dict[str, Any], prompts: list[list[int]]) -> tuple[dict[str, Handler], Reply]:
    """shoal's LLM, every actor in this process, with the bench's threads and KV cache; the
    prefix cache off, as the rounds repeat the same prompts."""
    import torch

    import shoal
    from shoal import LLM, SamplingParams

    torch.set_num_threads(int(config["threads"]))
    llm = LLM(
        config["model"],
        dtype=config["dtype"],
        max_model_len=int(config["max_model_len"]),
        kv_cache_memory_bytes=int(config["kv_bytes"]),
        enable_prefix_caching=False,
        seed=0,
    )

    def generate(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        inputs = [{"prompt_token_ids": ids} for ids in batch]
        outputs = llm.generate(inputs, params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    facts = {
        "shoal_file": shoal.__file__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    return Measures(generate, prompts, int(config["max_tokens"])).handlers(), facts


if __name__ == "__main__":
    main(load)
