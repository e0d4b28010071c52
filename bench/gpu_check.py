"""The checks and figures to take when a GPU is lent (one prepared run, e.g. through the device
tool): shoal's CUDA path has no CI, so this is where it is proven.

1. ``golden``: tiny random models of each architecture (fp32 and bf16) served by ``LLM`` on the
   GPU, eager and with CUDA graphs, greedy tokens against transformers' on the same GPU; with
   graphs, the replays counted (the graphs ran, not only the eager path).
2. ``subsystems``: prefix caching, async scheduling, a CPU KV tier and n-gram speculation at
   once with graphs, equal to transformers, with what each did counted.
3. ``bench``: a model of SmolLM2-135M's shape (random weights, bf16): offline throughput (64
   prompts x 128 tokens) and one request's decode, eager against CUDA graphs, beside
   transformers' ``generate`` (one request; the 64 as one left-padded batch); ``bench_1b`` the
   same on a model of Llama-3.2-1B's shape.
4. ``kernels``: the Triton kernel tests (``tests/kernels/test_triton_*.py``) compiled for the GPU
   and run there against the same torch references (``tests/kernels/on_device.py``).

    python bench/gpu_check.py [--sections golden,subsystems,bench,kernels,bench_1b]
        [--modes eager,graphs] [--variants llama,...]
        [--json FILE] [--device cpu (a dry run of the script)]

Last line: one JSON object with every figure and check.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from shoal.bus.messages.sampling import SamplingParams  # noqa: E402
from shoal.deploy.llm import LLM  # noqa: E402
from tests.fixtures.models import (  # noqa: E402
    build_checkpoint,
    build_markov_checkpoint,
    hf_greedy,
    make_prompts,
)

GOLDEN_VARIANTS = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe")
GOLDEN_TOKENS = 24
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    initializer_range=0.02,
)
LLAMA_1B_SHAPE = dict(  # Llama-3.2-1B's
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    initializer_range=0.02,
)
BENCH_SHAPES = {"bench": SMOLLM2_SHAPE, "bench_1b": LLAMA_1B_SHAPE}
DEVICE = "cuda"  # --device cpu: a dry run of the script itself
KV_BYTES = 2 << 30
MODE_OPTIONS: dict[str, dict[str, Any]] = {"eager": {"enforce_eager": True}, "graphs": {}}


def run_kernel_tests() -> dict[str, Any]:
    """The Triton tests on the GPU, in a child process (the interpreter must be off there)."""
    env = {**os.environ, "SHOAL_TEST_DEVICE": DEVICE, "TRITON_INTERPRET": "0"}
    files = sorted(str(p) for p in (ROOT / "tests" / "kernels").glob("test_triton_*.py"))
    # the project's addopts hold -q too, and -qq prints no "N passed" line
    cmd = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider"]
    cmd += files
    if _has_module("xdist"):
        cmd += ["-n", "8"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    print("\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:]), flush=True)
    summary = [line for line in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    found = re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary[-1] if summary else "")
    counts = {k: int(n) for n, k in found}
    return {"rc": proc.returncode, **counts, "seconds": round(time.perf_counter() - started, 1)}


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def shoal_greedy(model_dir: Path, prompts: list[list[int]], tokens: int, **options: Any):  # type: ignore[no-untyped-def]
    """shoal's greedy tokens on the GPU and the engine's CUDA-graph replay count."""
    with LLM(str(model_dir), device=DEVICE, kv_cache_memory_bytes=KV_BYTES, **options) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], greedy_params(tokens), use_tqdm=False
        )
        replays = graph_replays(llm)
    return [list(o.outputs[0].token_ids) for o in outs], replays


def graph_replays(llm: LLM) -> int | None:
    """CUDA-graph replays of the LLM's in-process workers (None: no worker keeps graphs)."""
    counts = [
        runner.graphs.num_replays
        for runner in _runners(llm)
        if getattr(runner, "graphs", None) is not None
    ]
    return sum(counts) if counts else None


def _runners(llm: LLM) -> list[Any]:
    return [a.runner for a in llm._actors if hasattr(a, "runner")]


def run_golden(modes: list[str], work: Path, variants: list[str]) -> list[dict[str, Any]]:
    rows = []
    prompts = make_prompts()
    for variant in variants:
        for dtype in ("float32", "bfloat16"):
            model_dir = build_checkpoint(variant, work / f"{variant}-{dtype}", dtype=dtype)
            torch_dtype = getattr(torch, dtype)
            expected = hf_greedy(model_dir, prompts, GOLDEN_TOKENS, torch_dtype, DEVICE)
            for mode in modes:
                row: dict[str, Any] = {"variant": variant, "dtype": dtype, "mode": mode}
                try:
                    got, replays = shoal_greedy(
                        model_dir,
                        prompts,
                        GOLDEN_TOKENS,
                        dtype=dtype,
                        cuda_graph_sizes=[1, 2, 4, 8],
                        **MODE_OPTIONS[mode],
                    )
                    row["equal"] = sum(g == e for g, e in zip(got, expected, strict=True))
                    row["of"] = len(prompts)
                    row["replays"] = replays
                    row["diverge_at_gap"] = divergence_gaps(
                        model_dir, torch_dtype, prompts, got, expected
                    )
                    if dtype != "float32":
                        row["fp32_prefers_ours_by"] = fp32_preference(
                            model_dir, prompts, got, expected
                        )
                except Exception as exc:  # reported, the run goes on
                    row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def divergence_gaps(
    model_dir: Path,
    dtype: torch.dtype,
    prompts: list[list[int]],
    got: list[list[int]],
    expected: list[list[int]],
) -> list[tuple[int, float]]:
    """For each prompt whose tokens differ from transformers': where, and how far
    transformers' own logit of shoal's token is below its best there (a near-tie is a few
    steps of the dtype's rounding)."""
    return [
        (at, round(float(logits.max() - logits[ours]), 4))
        for at, logits, ours, _ in logits_at_differences(model_dir, dtype, prompts, got, expected)
    ]


def fp32_preference(
    model_dir: Path, prompts: list[list[int]], got: list[list[int]], expected: list[list[int]]
) -> list[float]:
    """At each difference, the same weights in fp32: its logit of shoal's token minus its
    logit of transformers' (positive: fp32 sides with shoal)."""
    differences = logits_at_differences(model_dir, torch.float32, prompts, got, expected)
    return [
        round(float(logits[ours] - logits[theirs]), 4) for _, logits, ours, theirs in differences
    ]


def logits_at_differences(
    model_dir: Path,
    dtype: torch.dtype,
    prompts: list[list[int]],
    got: list[list[int]],
    expected: list[list[int]],
) -> list[tuple[int, torch.Tensor, int, int]]:
    """Per prompt whose tokens differ: the first differing position, transformers' fp32-cast
    logits there (its weights in ``dtype``, fed its own tokens up to there), shoal's token and
    transformers'."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.to(DEVICE).eval()
    found = []
    for prompt, ours, theirs in zip(prompts, got, expected, strict=True):
        at = _diverge(ours, theirs)
        if at is None or at >= min(len(ours), len(theirs)):
            continue
        with torch.no_grad():
            ids = torch.tensor([prompt + theirs[:at]], device=DEVICE)
            logits = model(ids).logits[0, -1].float()
        found.append((at, logits, ours[at], theirs[at]))
    return found


def _diverge(got: list[int], expected: list[int]) -> int | None:
    for i, (g, e) in enumerate(zip(got, expected, strict=False)):
        if g != e:
            return i
    return None if len(got) == len(expected) else min(len(got), len(expected))


def run_subsystems(work: Path) -> dict[str, Any]:
    """Prefix caching, async scheduling, a CPU KV tier behind a GPU cache of 8 blocks (each
    prompt evicts the ones before it, so the second round loads them from the tier) and n-gram
    speculation, on a model whose outputs loop (drafts accepted), with CUDA graphs: prompts one
    at a time, twice, each equal to transformers'; what each subsystem did, counted."""
    model_dir = build_markov_checkpoint(work / "markov")
    prompts = make_prompts()
    expected = hf_greedy(model_dir, prompts, GOLDEN_TOKENS, torch.float32, DEVICE)
    options: dict[str, Any] = {
        "dtype": "float32",
        "num_gpu_blocks_override": 8,
        "max_model_len": 128,
        "kv_offloading_size": 0.05,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
    }
    result: dict[str, Any] = {"equal": 0, "of": 2 * len(prompts)}
    with LLM(str(model_dir), device=DEVICE, **options) as llm:
        for _ in range(2):
            for prompt, want in zip(prompts, expected, strict=True):
                (out,) = llm.generate(
                    [{"prompt_token_ids": prompt}], greedy_params(GOLDEN_TOKENS), use_tqdm=False
                )
                result["equal"] += list(out.outputs[0].token_ids) == want
        (stats,) = [a.core.stats() for a in llm._actors if type(a).__name__ == "EngineCoreActor"]
        result["replays"] = graph_replays(llm)
    result["kv_offload_hits"] = stats.kv_offload_hits
    result["prefix_cache_hits"] = stats.prefix_cache_hits
    result["spec_accepted_tokens"] = stats.spec_decode_num_accepted_tokens
    print(json.dumps(result), flush=True)
    return result


def build_bench_model(work: Path, shape: dict[str, Any]) -> Path:
    """A random model of ``shape`` in bf16 (the tiny tokenizer beside it)."""
    out = work / f"shape-{shape['hidden_size']}x{shape['num_hidden_layers']}"
    return build_checkpoint("llama_tied", out, dtype="bfloat16", **shape)


def bench_prompts(count: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(45, 196, (count,), generator=gen).tolist()
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in lengths]


def time_shoal(model_dir: Path, prompts: list[list[int]], tokens: int, mode: str) -> dict[str, Any]:
    options = dict(dtype="bfloat16", max_model_len=2048, kv_cache_memory_bytes=KV_BYTES)
    started = time.perf_counter()
    with LLM(str(model_dir), device=DEVICE, **options, **MODE_OPTIONS[mode]) as llm:
        startup_s = time.perf_counter() - started
        params = greedy_params(tokens)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params, use_tqdm=False)
        figures: dict[str, Any] = {"mode": mode, "startup_s": round(startup_s, 1)}
        best = 0.0
        for _ in range(2):
            started = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            seconds = time.perf_counter() - started
            best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
        figures["offline_tok_s"] = round(best, 1)
        best_one = 0.0
        for _ in range(3):
            started = time.perf_counter()
            (out,) = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
            seconds = time.perf_counter() - started
            best_one = max(best_one, len(out.outputs[0].token_ids) / seconds)
        figures["single_tok_s"] = round(best_one, 1)
        figures["replays"] = graph_replays(llm)
    print(json.dumps(figures), flush=True)
    return figures


def time_transformers(model_dir: Path, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    model.to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    kwargs = dict(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
    figures: dict[str, Any] = {"mode": "transformers"}
    with torch.no_grad():
        one = torch.tensor([prompts[0]], device=DEVICE)
        model.generate(one, attention_mask=torch.ones_like(one), **kwargs)
        best_one = 0.0
        for _ in range(3):
            started = time.perf_counter()
            model.generate(one, attention_mask=torch.ones_like(one), **kwargs)
            _synchronize()
            best_one = max(best_one, tokens / (time.perf_counter() - started))
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(DEVICE), mask.to(DEVICE)
        best = 0.0
        for _ in range(2):
            started = time.perf_counter()
            model.generate(ids, attention_mask=mask, **kwargs)
            _synchronize()
            best = max(best, len(prompts) * tokens / (time.perf_counter() - started))
    figures.update(offline_tok_s=round(best, 1), single_tok_s=round(best_one, 1))
    print(json.dumps(figures), flush=True)
    return figures


def run_bench(
    modes: list[str], work: Path, count: int, tokens: int, shape: dict[str, Any]
) -> dict[str, Any]:
    model_dir = build_bench_model(work, shape)
    prompts = bench_prompts(count, shape["vocab_size"])
    result: dict[str, Any] = {"shape": shape, "prompts": count, "tokens": tokens}
    for mode in modes:
        result[mode] = time_shoal(model_dir, prompts, tokens, mode)
    result["transformers"] = time_transformers(model_dir, prompts, tokens)
    if "eager" in result and "graphs" in result:
        for key in ("offline_tok_s", "single_tok_s"):
            result[f"graphs_over_eager_{key}"] = round(
                result["graphs"][key] / result["eager"][key], 2
            )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="golden,subsystems,bench,kernels,bench_1b")
    parser.add_argument("--modes", default="eager,graphs")
    parser.add_argument("--variants", default=",".join(GOLDEN_VARIANTS))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    parser.add_argument("--json", type=Path, help="also write the result here after each section")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    sections, modes = args.sections.split(","), args.modes.split(",")
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else None,
        "torch": torch.__version__,
        "triton": _version("triton"),
    }
    sections_run = {
        "golden": lambda work: run_golden(modes, work, args.variants.split(",")),
        "subsystems": run_subsystems,
        **{
            name: functools.partial(
                run_bench, modes, count=args.prompts, tokens=args.tokens, shape=shape
            )
            for name, shape in BENCH_SHAPES.items()
        },
        "kernels": lambda work: run_kernel_tests(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in sections:
            result[name] = sections_run[name](Path(tmp))
            if args.json is not None:
                args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def _synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
