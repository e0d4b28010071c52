"""Weight-only quantization on a real model: single-request decode speed, the logits' error
against the float model and the perplexity of a fixed English text, per way of holding the
linear weights.

Modes (``--modes``, all by default), each a ``ModelRunner`` loaded on its own:

- ``fp32``, ``bf16``: the GGUF file dequantized to floats (``dequantize=True``), shoal's path
  before weights were kept quantized;
- ``int4``, ``int4-bf16``: the file's weights kept as they are stored (SmolLM2's Q4_1 layers as
  int4, its Q8_0 embedding as the tied head's int8), in an fp32 or a bf16 model (the quantized
  kernel runs in bf16 either way);
- ``int4-q8``: as ``int4-bf16`` with its 4-bit products' x rounded to 8 bits a group
  (``SHOAL_INT4_KERNEL=q8``: llama.cpp's numerics for Q4 weights; where the CPU has
  AVX512-VNNI, else left out of the default modes);
- ``int8``, ``int8-bf16``: the file dequantized, then ``quantization="int8"``.

Every mode is loaded first. Decode: one prompt (the text's first 32 tokens), ``--tokens``
(128) greedy tokens through the real scheduler; tok/s counts the steps after the first token
(the best of ``--rounds``, the modes taking turns in each round, after a warm-up). With a GGUF
model, llama.cpp takes its turn too (``--llama-cpp``, on by default): llama-cpp-python built
from source into a venv of its own under the peers cache the first time
(``bench/peers_lib/llama_env.py``), the same file, prompt tokens and threads, timed the same
way in its own process (``bench/peers_engines/llama_worker.py``); ``vs_llama_cpp`` is each
mode's decode speed over llama.cpp's, ``llama_cpp_agree`` how many of each mode's greedy tokens
match llama.cpp's before the first difference (llama.cpp also rounds the activations to 8
bits). Batched: ``--batch`` (16) such requests at once (prompts rotated by one token each),
``--tokens`` / 2 tokens each, output tokens/s over the whole run. Logits: every position of
``TEXT`` (about 300 tokens) in one prefill (timed: ``prefill_tok_s``), against the first
mode's (``fp32``, the reference): max and mean |error| and how often the argmax agrees.
Perplexity: ``exp`` of the mean negative log-likelihood of each next token of ``TEXT``.

    .venv/bin/python bench/quantized.py [--model default|NAME|DIR|FILE.gguf] [--modes fp32,int4]
        [--tokens 128] [--batch 16] [--rounds 5] [--threads 2] [--no-llama-cpp]

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.peers_lib.cache import peers_cache
from bench.peers_lib.engine_proc import ENGINES_DIR, EngineProcess, EngineSpec, WorkerError
from bench.peers_lib.llama_env import ensure_llama_env
from bench.throughput import BenchModel, named_model
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import ExecuteStep, NewRequestData
from shoal.config.deployment import ShoalConfig
from shoal.engine.core.request import Request
from shoal.engine.core.scheduler import Scheduler
from shoal.kernels.gemm import PreparedWeight
from shoal.kernels.strip_gemm import code_strips_round_x
from shoal.workers.layers.weight_quantizing import INT4_KERNEL_ENV
from shoal.workers.model_runner import ModelRunner

# mode -> the options it loads with
MODES: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32", "dequantize": True},
    "bf16": {"dtype": "bfloat16", "dequantize": True},
    "int4": {"dtype": "float32"},
    "int4-bf16": {"dtype": "bfloat16"},
    "int4-q8": {"dtype": "bfloat16", INT4_KERNEL_ENV: "q8"},
    "int8": {"dtype": "float32", "dequantize": True, "quantization": "int8"},
    "int8-bf16": {"dtype": "bfloat16", "dequantize": True, "quantization": "int8"},
}
BLOCK_SIZE = 16
PROMPT_TOKENS = 32
MAX_MODEL_LEN = 1024
LLAMA_CPP = "llama.cpp"
LLAMA_LOAD_TIMEOUT_S = 300.0
LLAMA_DECODE_TIMEOUT_S = 300.0
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


def available_modes() -> list[str]:
    """Every mode this CPU runs (``int4-q8`` needs AVX512-VNNI)."""
    return [mode for mode in MODES if mode != "int4-q8" or code_strips_round_x()]


def load_runner(model_dir: Path, options: dict[str, Any]) -> ModelRunner:
    options = dict(options)
    int4_kernel = options.pop(INT4_KERNEL_ENV, None)
    config = ShoalConfig.from_options(
        model=str(model_dir),
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        kv_cache_memory_bytes=128 << 20,
        **options,
    )
    runner = ModelRunner(config)
    asked = {INT4_KERNEL_ENV: int4_kernel} if int4_kernel else {}
    with patch.dict(os.environ, asked):  # read as the codes are packed, at load
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
        if isinstance(weight, torch.Tensor):
            total += weight.shape[0] * weight.shape[1] * weight.element_size()
        elif isinstance(weight, PreparedWeight):  # packed for a kernel: what a product reads
            total += weight.nbytes
    return total


def run(
    runner: ModelRunner, prompts: list[list[int]], tokens: int, tag: str
) -> tuple[list[float], list[Request]]:
    """``prompts`` through the scheduler, ``tokens`` greedy tokens each; the time after each
    step (the first: before any), and the requests (their output tokens)."""
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
    requests = [
        Request(f"{tag}-{i}", prompt, params, client_id="bench", arrival_time=float(i))
        for i, prompt in enumerate(prompts)
    ]
    for request in requests:
        scheduler.add_request(request)
    stamps = [time.perf_counter()]
    while scheduler.has_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(out.to_message()))
        stamps.append(time.perf_counter())
    return stamps, requests


def decode(runner: ModelRunner, prompt: list[int], tokens: int, tag: str) -> dict[str, Any]:
    """One request: seconds to the first token, decode tokens/s after it, its tokens."""
    stamps, (request,) = run(runner, [prompt], tokens, tag)
    decode_s = stamps[-1] - stamps[1]
    return {
        "ttft_s": stamps[1] - stamps[0],
        "decode_tok_s": (len(stamps) - 2) / decode_s,
        "token_ids": list(request.output_token_ids),
    }


def batched(runner: ModelRunner, prompt: list[int], count: int, tokens: int) -> float:
    """Output tokens/s of ``count`` requests at once."""
    prompts = [[prompt[0], *prompt[1 + i :], *prompt[1 : 1 + i]] for i in range(count)]
    stamps, _ = run(runner, prompts, tokens, "batch")
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


Decoder = Callable[[int, str], dict[str, Any]]  # (tokens, tag) -> decode's figures


def best_decodes(decoders: dict[str, Decoder], tokens: int, rounds: int) -> dict[str, dict]:
    """Each one's best single-request decode over ``rounds``, taking turns within each round
    (so a machine's drift touches them alike), after a warm-up."""
    for name, run_decode in decoders.items():
        run_decode(8, f"{name}-warm")
    best: dict[str, dict] = {}
    for i in range(rounds):
        for name, run_decode in decoders.items():
            figures = run_decode(tokens, f"{name}-{i}")
            if name not in best or figures["decode_tok_s"] > best[name]["decode_tok_s"]:
                best[name] = figures
    return best


def shoal_decoder(runner: ModelRunner, prompt: list[int]) -> Decoder:
    return lambda tokens, tag: decode(runner, prompt, tokens, tag)


def start_llama_cpp(model: BenchModel, prompt: list[int], threads: int) -> EngineProcess | str:
    """llama.cpp's worker on the model's GGUF file, loaded (its venv built the first time), or
    why it cannot run."""
    if model.gguf_file is None:
        return "the model is not a GGUF file"
    env = ensure_llama_env(peers_cache() / "install.log")
    if isinstance(env, str):
        return env
    run_dir = peers_cache() / "runs" / time.strftime("quantized-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    prompts_file = run_dir / "prompt.json"
    prompts_file.write_text(json.dumps([prompt]))
    config = {
        "model": str(model.gguf_file),
        "threads": threads,
        "prompts_file": str(prompts_file),
        "max_model_len": MAX_MODEL_LEN,
    }
    script = str(ENGINES_DIR / "llama_worker.py")
    spec = EngineSpec(LLAMA_CPP, str(env.python), script, {"OMP_NUM_THREADS": str(threads)})
    worker = EngineProcess(spec, config, run_dir, "llama-cpp")
    try:
        worker.wait_ready(LLAMA_LOAD_TIMEOUT_S)
    except WorkerError as exc:
        worker.close()
        return str(exc)
    return worker


def llama_cpp_decoder(worker: EngineProcess) -> Decoder:
    return lambda tokens, tag: worker.call("decode", LLAMA_DECODE_TIMEOUT_S, tokens=tokens)


def leading_agreement(tokens: list[int], reference: list[int]) -> int:
    """How many of ``tokens`` equal ``reference``'s before the first difference."""
    count = 0
    for mine, theirs in zip(tokens, reference, strict=False):
        if mine != theirs:
            break
        count += 1
    return count


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
    parser.add_argument("--modes", default=",".join(available_modes()))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="requests at once (0: skip)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--llama-cpp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="llama.cpp's decode on the same GGUF file beside shoal's (built the first time)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = named_model(args.model)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model.directory)).encode(TEXT)[: model.max_len]
    modes = args.modes.split(",")
    runners = {mode: load_runner(model.directory, MODES[mode]) for mode in modes}
    prompt = ids[:PROMPT_TOKENS]
    decoders = {mode: shoal_decoder(runner, prompt) for mode, runner in runners.items()}
    llama = start_llama_cpp(model, prompt, args.threads) if args.llama_cpp else "--no-llama-cpp"
    if isinstance(llama, str):
        print(f"llama.cpp not measured: {llama}", flush=True)
    else:
        decoders[LLAMA_CPP] = llama_cpp_decoder(llama)
    try:
        decodes = best_decodes(decoders, args.tokens, args.rounds)
    finally:
        if not isinstance(llama, str):
            llama.close()
    llama_figures = decodes.pop(LLAMA_CPP, None)
    results: dict[str, dict] = {}
    reference: torch.Tensor | None = None
    for mode, runner in runners.items():
        figures = {**decodes[mode], **measure(runner, ids, args)}
        tokens = figures.pop("token_ids")
        if llama_figures is not None:
            figures["vs_llama_cpp"] = figures["decode_tok_s"] / llama_figures["decode_tok_s"]
            figures["llama_cpp_agree"] = leading_agreement(tokens, llama_figures["token_ids"])
        logits = figures.pop("logits")
        reference = logits if reference is None else reference
        figures.update(compare(logits, reference))
        results[mode] = figures
        _print_line(mode, figures)
    llama_summary = _llama_summary(llama, llama_figures)
    if "skipped" not in llama_summary:
        _print_line(LLAMA_CPP, {k: llama_summary[k] for k in ("ttft_s", "decode_tok_s")})
    base = results[modes[0]]["decode_tok_s"]
    summary = {
        "model": model.name,
        "threads": args.threads,
        "text_tokens": len(ids),
        "reference": modes[0],
        "modes": results,
        "decode_speedup": {m: r["decode_tok_s"] / base for m, r in results.items()},
        "llama_cpp": llama_summary,
    }
    print(json.dumps(summary))


def _llama_summary(llama: EngineProcess | str, figures: dict[str, Any] | None) -> dict[str, Any]:
    """llama.cpp's decode figures and versions, or why it was not measured."""
    if isinstance(llama, str) or figures is None:
        return {"skipped": llama if isinstance(llama, str) else "no figures"}
    kept = {k: v for k, v in figures.items() if k != "token_ids"}
    return {**kept, **llama.ready}


def _print_line(name: str, figures: dict[str, Any]) -> None:
    print(f"{name:10s} " + " ".join(f"{k}={_short(v)}" for k, v in figures.items()), flush=True)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
