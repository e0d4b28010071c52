"""Weight-only quantization on a real model: single-request decode speed, the logits' error
against the float model and the perplexity of a fixed English text, per way of holding the
linear weights.

Modes (``--modes``, all by default), each a ``ModelRunner`` loaded on its own:

- ``fp32``, ``bf16``: the GGUF file dequantized to floats (``dequantize=True``), shoal's path
  before weights were kept quantized;
- ``int4``, ``int4-bf16``: the file's weights kept as they are stored (SmolLM2's Q4_1 layers as
  int4, its Q8_0 embedding as the tied head's int8), in an fp32 or a bf16 model (the quantized
  kernel runs in bf16 either way);
- ``int8``, ``int8-bf16``: the file dequantized, then ``quantization="int8"``.

Every mode is loaded first. Decode: one prompt (the text's first 32 tokens), ``--tokens``
(128) greedy tokens through the real scheduler; tok/s counts the steps after the first token
(the best of ``--rounds``, the modes taking turns in each round, after a warm-up). Batched:
``--batch`` (16) such requests at once (prompts rotated by one token each), ``--tokens`` / 2
tokens each, output tokens/s over the whole run. Logits: every position of ``TEXT`` (about 300
tokens) in one prefill (timed: ``prefill_tok_s``), against the first mode's (``fp32``, the
reference): max and mean |error| and how often the argmax agrees. Perplexity: ``exp`` of the
mean negative log-likelihood of each next token of ``TEXT``.

    .venv/bin/python bench/quantized.py [--model default|NAME|DIR|FILE.gguf] [--modes fp32,int4]
        [--tokens 128] [--batch 16] [--rounds 5] [--threads 2]

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import named_model
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import ExecuteStep, NewRequestData
from shoal.config.deployment import ShoalConfig
from shoal.engine.core.request import Request
from shoal.engine.core.scheduler import Scheduler
from shoal.kernels.quant_gemm import QuantizedWeight
from shoal.workers.model_runner import ModelRunner

# mode -> the options it loads with
MODES: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32", "dequantize": True},
    "bf16": {"dtype": "bfloat16", "dequantize": True},
    "int4": {"dtype": "float32"},
    "int4-bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "dequantize": True, "quantization": "int8"},
    "int8-bf16": {"dtype": "bfloat16", "dequantize": True, "quantization": "int8"},
}
BLOCK_SIZE = 16
PROMPT_TOKENS = 32
TEXT = (
    "The lighthouse at the end of the harbour was built in the spring of 1874, after two "
    "fishing boats were lost on the rocks in a single winter storm. The town paid for it with "
    "a tax on every barrel of herring landed at the quay, and the keeper, a retired sailor "
    "named Thomas Reed, lived in the small stone cottage at its foot for thirty-one years. "
    "Each evening he climbed the ninety-six steps to light the lamp, trimmed the wick at "
    "midnight, and wrote the weather in a leather book: the wind, the sea, the ships that "
    "passed and the hour they passed. Those books are kept today in the town library, and "
    "they tell a quiet story of a changing coast. In the first years the entries are full of "
    "sailing ships, schooners and brigs carrying coal, timber and salt. By the turn of the "
    "century steamers appear more often than sails, and the keeper notes their smoke long "
    "before he can see their hulls. He records the great gale of 1893, when the waves broke "
    "over the gallery and the glass of the lantern cracked, and the calm summer of 1901, when "
    "the sea was so still that he could hear the church bells of the next village across the "
    "bay. When Reed retired, his daughter took over the light, and she kept it until the lamp "
    "was replaced by an electric one that needed no keeper at all. The cottage is now a small "
    "museum. Visitors can climb the steps, look out over the water, and read a page of the "
    "old books, written in a careful hand by a man who watched the same stretch of sea every "
    "night of his working life and never once, he wrote, found it boring."
)


def load_runner(model_dir: Path, options: dict[str, Any]) -> ModelRunner:
    config = ShoalConfig.from_options(
        model=str(model_dir),
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        max_num_seqs=4,
        kv_cache_memory_bytes=128 << 20,
        **options,
    )
    runner = ModelRunner(config)
    runner.load()
    return runner


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of every weight a linear layer or the LM head multiplies by."""
    total = 0
    for name, module in runner.model.named_modules():
        weight = getattr(module, "weight", None)
        if name.endswith("lm_head"):
            weight = module.head_weight()  # type: ignore[operator]
        elif not name.endswith("_proj"):
            continue
        if isinstance(weight, QuantizedWeight):
            total += weight.nbytes
        elif isinstance(weight, torch.Tensor):
            total += weight.shape[0] * weight.shape[1] * weight.element_size()
    return total


def run(runner: ModelRunner, prompts: list[list[int]], tokens: int, tag: str) -> list[float]:
    """``prompts`` through the scheduler, ``tokens`` greedy tokens each; the time after each
    step (the first: before any)."""
    config = runner.config
    facts = runner.facts
    assert facts is not None
    scheduler = Scheduler(
        config.scheduler_config,
        config.cache_config,
        num_blocks=facts.num_blocks,
        max_model_len=facts.max_model_len,
    )
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        request = Request(f"{tag}-{i}", prompt, params, client_id="bench", arrival_time=float(i))
        scheduler.add_request(request)
    stamps = [time.perf_counter()]
    while scheduler.has_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(out.to_message()))
        stamps.append(time.perf_counter())
    return stamps


def decode(runner: ModelRunner, prompt: list[int], tokens: int, tag: str) -> dict[str, float]:
    """One request: seconds to the first token, decode tokens/s after it."""
    stamps = run(runner, [prompt], tokens, tag)
    decode_s = stamps[-1] - stamps[1]
    return {"ttft_s": stamps[1] - stamps[0], "decode_tok_s": (len(stamps) - 2) / decode_s}


def batched(runner: ModelRunner, prompt: list[int], count: int, tokens: int) -> float:
    """Output tokens/s of ``count`` requests at once."""
    prompts = [[prompt[0], *prompt[1 + i :], *prompt[1 : 1 + i]] for i in range(count)]
    stamps = run(runner, prompts, tokens, "batch")
    return count * tokens / (stamps[-1] - stamps[0])


@torch.inference_mode()
def text_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab] fp32
    """Logits at every position of ``ids`` from one prefill of a fresh request (the runner's
    own step pieces, as tests/unit/test_model_runner.py's ``full_logits``)."""
    blocks = list(range(1, 1 + -(-len(ids) // BLOCK_SIZE)))
    request = NewRequestData(
        req_id="text",
        prompt_token_ids=ids,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=1),
        block_ids=blocks,
        num_computed_tokens=0,
        num_scheduled_tokens=len(ids),
    )
    runner._apply_diff(ExecuteStep(step_id=10_000, new_requests=[request]))
    inputs = runner.batch.prepare_inputs(["text"], [len(ids)])
    logits = runner.model.compute_logits(runner._forward(inputs))
    runner._apply_diff(ExecuteStep(step_id=10_001, finished_req_ids=["text"]))
    return logits


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    targets = torch.tensor(ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), targets)
    return math.exp(nll.item())


def best_decodes(runners: dict[str, ModelRunner], prompt: list[int], args) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    """Each mode's best single-request decode over ``args.rounds``, the modes taking turns
    within each round (so a machine's drift touches them alike), after a warm-up."""
    for mode, runner in runners.items():
        decode(runner, prompt, 8, f"{mode}-warm")
    best: dict[str, dict] = {}
    for i in range(args.rounds):
        for mode, runner in runners.items():
            figures = decode(runner, prompt, args.tokens, f"{mode}-{i}")
            if mode not in best or figures["decode_tok_s"] > best[mode]["decode_tok_s"]:
                best[mode] = figures
    return best


def measure(runner: ModelRunner, ids: list[int], args: argparse.Namespace) -> dict:
    """A mode's batch, prefill and text figures, and the text's logits."""
    prompt = ids[:PROMPT_TOKENS]
    batch_tok_s = batched(runner, prompt, args.batch, args.tokens // 2) if args.batch else None
    started = time.perf_counter()
    logits = text_logits(runner, ids)
    prefill_s = time.perf_counter() - started
    assert runner.facts is not None
    return {
        "linear_weights": runner.facts.linear_weights,
        "weight_bytes": weight_bytes(runner),
        "batch_tok_s": batch_tok_s,
        "prefill_tok_s": len(ids) / prefill_s,
        "ppl": perplexity(logits, ids),
        "logits": logits,
    }


def compare(logits: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    error = (logits - reference).abs()
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    return {
        "logit_max_abs_err": error.max().item(),
        "logit_mean_abs_err": error.mean().item(),
        "top1_agree": agree.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="requests at once (0: skip)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = named_model(args.model)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model.directory)).encode(TEXT)[: model.max_len]
    modes = args.modes.split(",")
    runners = {mode: load_runner(model.directory, MODES[mode]) for mode in modes}
    decodes = best_decodes(runners, ids[:PROMPT_TOKENS], args)
    results: dict[str, dict] = {}
    reference: torch.Tensor | None = None
    for mode, runner in runners.items():
        figures = {**decodes[mode], **measure(runner, ids, args)}
        logits = figures.pop("logits")
        reference = logits if reference is None else reference
        figures.update(compare(logits, reference))
        results[mode] = figures
        print(f"{mode:10s} " + " ".join(f"{k}={_short(v)}" for k, v in figures.items()), flush=True)
    base = results[modes[0]]["decode_tok_s"]
    summary = {
        "model": model.name,
        "threads": args.threads,
        "text_tokens": len(ids),
        "reference": modes[0],
        "modes": results,
        "decode_speedup": {m: r["decode_tok_s"] / base for m, r in results.items()},
    }
    print(json.dumps(summary))


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
