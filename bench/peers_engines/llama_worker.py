"""bench/quantized.py's llama.cpp worker: llama-cpp-python's ``Llama`` on the GGUF file itself
(its quantized weights as stored), driven by ``worker_loop``. Run by path in llama.cpp's own
venv (which has no shoal): ``python llama_worker.py CONFIG FD``.

``decode``: the first prompt, then the command's ``tokens`` greedy tokens (end of sequence
ignored: the count is fixed), timed as bench/quantized.py times shoal: seconds to the first
token, tokens/s after it. The context is cleared before each run (no prefix kept from the
last)."""

from __future__ import annotations

import time
from typing import Any

from worker_loop import Handler, Reply, main


def load(config: dict[str, Any], prompts: list[list[int]]) -> tuple[dict[str, Handler], Reply]:
    import llama_cpp

    threads = int(config["threads"])
    llm = llama_cpp.Llama(
        model_path=config["model"],
        n_ctx=int(config["max_model_len"]),
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        verbose=False,
    )

    def greedy(prompt: list[int], count: int) -> tuple[list[int], list[float]]:
        """``count`` greedy tokens; the time after each."""
        llm.reset()
        tokens, stamps = [], []
        for token in llm.generate(
            prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
        ):
            tokens.append(int(token))
            stamps.append(time.perf_counter())
            if len(tokens) == count:
                break
        return tokens, stamps

    def decode(command: dict[str, Any]) -> Reply:
        started = time.perf_counter()
        tokens, stamps = greedy(prompts[0], int(command["tokens"]))
        return {
            "ttft_s": stamps[0] - started,
            "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "token_ids": tokens,
        }

    facts = {"llama_cpp_python": llama_cpp.__version__, "threads": threads}
    return {"decode": decode}, facts


if __name__ == "__main__":
    main(load)
