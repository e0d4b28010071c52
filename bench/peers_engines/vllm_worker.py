"""bench/peers.py's vLLM worker: vLLM's offline ``LLM`` on the bench's Hugging Face
directory, driven by ``worker_loop``. Run by path in vLLM's own venv (which has no shoal):
``python vllm_worker.py CONFIG FD``, with ``VLLM_CPU_OMP_THREADS_BIND`` set by the parent.
The engine is built under the ``__main__`` guard, as vLLM spawns its engine core process."""

from __future__ import annotations

from typing import Any

from worker_loop import Handler, Measures, Reply, main


def load(config: dict[str, Any], prompts: list[list[int]]) -> tuple[dict[str, Handler], Reply]:
    """vLLM's LLM with the bench's KV cache and context; prefix caching off (the rounds repeat
    the same prompts); graphs compiled unless ``eager``."""
    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=config["model"],
        dtype=config["dtype"],
        max_model_len=int(config["max_model_len"]),
        kv_cache_memory_bytes=int(config["kv_bytes"]),
        enable_prefix_caching=False,
        enforce_eager=bool(config["eager"]),
        seed=0,
    )

    def generate(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        inputs: Any = [{"prompt_token_ids": ids} for ids in batch]
        outputs = llm.generate(inputs, params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    facts = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return Measures(generate, prompts, int(config["max_tokens"])).handlers(), facts


if __name__ == "__main__":
    main(load)
