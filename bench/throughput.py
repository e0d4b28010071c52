"""Offline generation throughput: shoal (real scheduler + model runner) against transformers on
the same model (a random Llama of about 25M parameters, or ``--model``), in two transformers
modes.

64 prompts of 32..512 random tokens, max_tokens drawn per request from 16..256 (seed 0), greedy,
eos ignored. ``--model MODEL`` benchmarks a real checkpoint instead of the random Llama:
``default`` (the default model, SmolLM2-135M-Instruct), a built-in name, a Hugging Face
directory or a GGUF file, resolved as ``shoal serve`` resolves it (``resolve_model``). shoal
loads the resolved directory; transformers loads the same weights, from the GGUF file itself
when the directory is a GGUF view (dequantized to ``--dtype``), else from the directory. The
prompts stay random token ids, drawn within the model's vocabulary, and the lengths are scaled
down if prompt plus output would not fit the model's context. shoal's KV cache is ``--kv-bytes``
when given, else 512 MiB or, if more, enough for the whole workload at once (no preemption). The
two transformers modes:

- static: ``generate()`` on left-padded batches grouped by max_tokens so each batch wastes few
  steps, credited only with the tokens each request asked for. The batch size is swept
  (``--hf-batches``, 8,16,32,64) and the best one kept.
- continuous: transformers' own continuous batching (the paged path behind ``generate_batch``),
  driven through ``continuous_batching_context_manager`` so each request keeps its own
  ``max_new_tokens`` (``generate_batch`` takes one for all). On the CPU in fp32 it works with
  ``sdpa`` attention (used here; ``eager`` becomes its ``paged|eager`` and works too, no faster;
  no flash kernel there; its greedy tokens matched ``generate()``'s when checked); its cache is
  sized here (``num_blocks`` for the whole workload, ``max_batch_tokens`` = shoal's token
  budget) because without ``psutil`` it would try to size itself from the host's whole memory.
  The manager persists across rounds, as shoal's runner does, so neither side's timed rounds pay
  for allocating its cache; its block sharing (prefix cache) is off, as its cached blocks would
  outlive a round (shoal's scheduler, with the prefix cache, is new every round; the prompts
  share no prefix within a round).

Every side loads once and gets one untimed warm-up, then ``--rounds`` timed rounds (3; 1 with
``--quick``), alternating which side goes first; each keeps its best round. The batch sweep runs
in round 0; later rounds rerun only the best batch size so far, so the best static batch gets as
many rounds as shoal. ``ratio`` is shoal over the faster transformers mode. shoal's engine
overhead is the share of its step time (schedule + diff + input building + sampling + output
update) spent outside the bare model forward.

    .venv/bin/python bench/throughput.py [--model default|NAME|DIR|FILE.gguf] [--device cpu|cuda]
        [--dtype float32] [--quick] [--rounds N] [--hf-batches 8,16,32,64] [--skip-hf-cb]
        [--threads N]

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal.bus.messages.sampling import SamplingParams
from shoal.config.deployment import ShoalConfig
from shoal.engine.core.request import Request
from shoal.engine.core.scheduler import Scheduler
from shoal.workers.config import CheckpointConfig
from shoal.workers.kv_cache import bytes_per_block
from shoal.workers.model_runner import ModelRunner

VOCAB = 4096
MAX_MODEL_LEN = 1024
BLOCK_SIZE = 16
DEFAULT_KV_BYTES = 512 * 1024 * 1024
MIN_PROMPT, MIN_OUTPUT = 32, 16
WARMUP_TOKENS = 4
Workload = tuple[list[list[int]], list[int]]


@dataclass(frozen=True)
class BenchModel:
    """The model both sides run: the directory shoal loads, the name the report gives it, the
    GGUF file behind the directory (None: transformers reads the directory), its vocabulary and
    the context the workload stays within."""

    directory: Path
    name: str
    gguf_file: Path | None
    vocab_size: int
    max_len: int


def build_model(out_dir: Path, dtype: str, tiny: bool = False, max_len: int = MAX_MODEL_LEN) -> int:
    """A random Llama of ~25M parameters (~0.6M when ``tiny``, for smoke tests) with a
    context of ``max_len``, saved with save_pretrained; returns its size."""
    import transformers

    hidden, ffn, layers = (64, 128, 2) if tiny else (512, 1536, 6)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=max_len,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(str(out_dir))
    return sum(p.numel() for p in model.parameters())


def random_model(out_dir: Path, args: argparse.Namespace) -> tuple[BenchModel, int]:
    """The random Llama, built into ``out_dir``, and its size."""
    num_params = build_model(out_dir, args.dtype, args.tiny)
    return BenchModel(out_dir, "random Llama", None, VOCAB, MAX_MODEL_LEN), num_params


def named_model(model: str) -> BenchModel:
    """``--model``, resolved as the serve command resolves it (``default``: the default model);
    its vocabulary and context from the directory's config.json."""
    from shoal.deploy.model_source import resolve_model
    from shoal.workers.gguf import gguf_source

    source = resolve_model(None if model == "default" else model)
    directory = Path(source.directory)
    cfg = CheckpointConfig.from_dir(directory)
    context = min(cfg.max_position_embeddings, cfg.sliding_window or MAX_MODEL_LEN)
    return BenchModel(
        directory=directory,
        name=source.served_name or model,
        gguf_file=gguf_source(directory),
        vocab_size=cfg.vocab_size,
        max_len=min(context, MAX_MODEL_LEN),
    )


def length_bounds(quick: bool, max_len: int) -> tuple[int, int]:
    """The longest prompt and output drawn: 512 and 256 (128 and 32 with ``--quick``), scaled
    down so that prompt plus output fit a shorter context."""
    hi_len, hi_out = (128, 32) if quick else (512, 256)
    if hi_len + hi_out <= max_len:
        return hi_len, hi_out
    if max_len < MIN_PROMPT + MIN_OUTPUT:
        raise SystemExit(f"a context of {max_len} tokens is too short for this benchmark")
    hi_out = max(MIN_OUTPUT, hi_out * max_len // (hi_len + hi_out))
    return max_len - hi_out, hi_out


def workload(
    num_prompts: int, quick: bool, vocab: int = VOCAB, max_len: int = MAX_MODEL_LEN
) -> Workload:
    gen = torch.Generator().manual_seed(0)
    hi_len, hi_out = length_bounds(quick, max_len)
    lengths = torch.randint(MIN_PROMPT, hi_len + 1, (num_prompts,), generator=gen).tolist()
    max_tokens = torch.randint(MIN_OUTPUT, hi_out + 1, (num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    return prompts, max_tokens


def warmup_workload(work: Workload, num: int) -> Workload:
    """The first ``num`` prompts with a few output tokens each: touches every code path once."""
    prompts = work[0][:num]
    return prompts, [WARMUP_TOKENS] * len(prompts)


# ----- shoal


def kv_bytes(model: BenchModel, args: argparse.Namespace, work: Workload) -> int:
    """``--kv-bytes``, else 512 MiB or, if more, the whole workload's KV at once."""
    if args.kv_bytes is not None:
        return int(args.kv_bytes)
    cfg = CheckpointConfig.from_dir(model.directory)
    block = bytes_per_block(
        num_layers=cfg.num_layers,
        block_size=BLOCK_SIZE,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=getattr(torch, args.dtype),
    )
    blocks = sum(-(-(len(p) + m) // BLOCK_SIZE) for p, m in zip(*work, strict=True))
    return max(DEFAULT_KV_BYTES, (blocks + 1) * block)  # block 0 is reserved


def open_shoal(model: BenchModel, args: argparse.Namespace, work: Workload) -> tuple[Any, Any]:
    """A loaded model runner and its config; each round builds a fresh scheduler on them."""
    config = ShoalConfig.from_options(
        model=str(model.directory),
        dtype=args.dtype,
        device=args.device,
        block_size=BLOCK_SIZE,
        max_model_len=model.max_len,
        max_num_seqs=len(work[0]),
        max_num_batched_tokens=args.batched_tokens,
        kv_cache_memory_bytes=kv_bytes(model, args, work),
    )
    runner = ModelRunner(config)
    return runner, (config, runner.load())


def shoal_params(shoal: tuple[Any, Any]) -> int:
    """The parameters of shoal's loaded model (tied weights counted once)."""
    return sum(p.numel() for p in shoal[0].model.parameters())


def run_shoal(shoal: tuple[Any, Any], work: Workload, tag: str) -> dict:
    """The whole workload through a fresh scheduler (empty prefix cache) on the loaded runner."""
    runner, (config, facts) = shoal
    scheduler = Scheduler(
        config.scheduler_config,
        config.cache_config,
        num_blocks=facts.num_blocks,
        max_model_len=facts.max_model_len,
    )
    for i, (prompt, n) in enumerate(zip(*work, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        scheduler.add_request(
            Request(f"{tag}{i}", prompt, params, client_id="bench", arrival_time=float(i))
        )
    num_out = step_s = forward_s = 0.0
    num_steps = 0
    started = time.perf_counter()
    while scheduler.has_requests():
        t0 = time.perf_counter()
        sched_out = scheduler.schedule()
        result = runner.execute(sched_out.to_message())
        outputs = scheduler.update_from_output(sched_out, result)
        step_s += time.perf_counter() - t0
        forward_s += runner.timings.forward_s
        num_steps += 1
        num_out += sum(len(o.new_token_ids) for outs in outputs.values() for o in outs)
    elapsed = time.perf_counter() - started
    return {
        "tokens": int(num_out),
        "seconds": elapsed,
        "steps": num_steps,
        "step_s": step_s,
        "forward_s": forward_s,
    }


# ----- transformers


def load_hf(model_dir: Path, args: argparse.Namespace, gguf_file: Path | None = None) -> Any:
    """The checkpoint in transformers with eos disabled (every request runs to its max_tokens):
    read from ``gguf_file`` (dequantized) when given (``model_dir`` is its view), else from
    ``model_dir``."""
    import transformers

    source, extra = model_dir, {}
    if gguf_file is not None:
        source, extra = gguf_file.parent, {"gguf_file": gguf_file.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(source), dtype=getattr(torch, args.dtype), **extra
    )
    model = model.to(args.device).eval()
    model.generation_config.eos_token_id = None
    return model


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf_static(model: Any, work: Workload, batch: int, device: str) -> dict:
    """``generate()`` on left-padded batches of ``batch`` requests grouped by max_tokens."""
    prompts, max_tokens = work
    order = sorted(range(len(prompts)), key=lambda i: max_tokens[i])
    started = time.perf_counter()
    for begin in range(0, len(order), batch):
        chunk = order[begin : begin + batch]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, i in enumerate(chunk):  # left padding
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        with torch.inference_mode():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=max(max_tokens[i] for i in chunk),
                pad_token_id=0,
            )
    synchronize(device)
    return {"tokens": sum(max_tokens), "seconds": time.perf_counter() - started}


def cb_settings(full: Workload, args: argparse.Namespace) -> tuple[Any, Any]:
    """(generation config, continuous batching config) for the whole workload resident at once."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    prompts, max_tokens = full
    page = args.hf_cb_page_size
    blocks = sum(-(-(len(p) + m) // page) for p, m in zip(prompts, max_tokens, strict=True))
    generation = GenerationConfig(
        do_sample=False, eos_token_id=-1, max_new_tokens=max(max_tokens), pad_token_id=0
    )
    batching = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=blocks + len(prompts),
        max_batch_tokens=args.batched_tokens,
        max_requests_per_batch=len(prompts),
        allow_block_sharing=False,  # its prefix cache outlives a round; shoal's does not
    )
    return generation, batching


def run_hf_continuous(model: Any, work: Workload, settings: tuple[Any, Any], device: str) -> dict:
    """Every request submitted at once to transformers' continuous batching manager, each with
    its own max_new_tokens; tokens counted from the finished outputs."""
    generation, batching = settings
    started = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=generation,
        continuous_batching_config=batching,
        block=True,
        persistent_manager=True,
    ) as manager:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(*work, strict=True)]
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped early")
    synchronize(device)
    tokens = sum(len(done[i].generated_tokens) for i in ids)
    if tokens != sum(work[1]):
        raise RuntimeError(f"continuous batching made {tokens} of {sum(work[1])} tokens")
    return {"tokens": tokens, "seconds": time.perf_counter() - started}


# ----- rounds


def tok_s(run: dict) -> float:
    return float(run["tokens"] / run["seconds"])


def fastest(runs: list[dict]) -> dict:
    return min(runs, key=lambda run: run["seconds"])


class Sides:
    """Each side's loaded model and every timed run it made, keyed by mode."""

    def __init__(self, model: BenchModel, args: argparse.Namespace, work: Workload) -> None:
        self.args, self.work, self.model = args, work, model
        self.shoal = open_shoal(model, args, work)
        self.hf = None if args.skip_hf else load_hf(model.directory, args, model.gguf_file)
        self.cb = cb_settings(work, args) if self.hf is not None and args.hf_cb else None
        self.batches = sorted({min(b, len(work[0])) for b in args.hf_batches})
        self.runs: dict[str, list[dict]] = {}
        self.warmed_up: list[str] = []

    def warm_up(self) -> None:
        """One untimed small run of every mode (and static batch size) that is timed later."""
        small = warmup_workload(self.work, max(self.batches))
        run_shoal(self.shoal, small, "warmup")
        self.warmed_up.append("shoal")
        for batch in self.batches if self.hf is not None else []:
            run_hf_static(self.hf, small, batch, self.args.device)
            self.warmed_up.append(f"hf_static_{batch}")
        if self.cb is not None:
            run_hf_continuous(self.hf, small, self.cb, self.args.device)
            self.warmed_up.append("hf_continuous")

    def best_batch(self) -> int:
        return max(self.batches, key=lambda b: tok_s(fastest(self.runs[f"hf_static_{b}"])))

    def run_round(self, index: int) -> None:
        """shoal, then transformers (the other way round on odd rounds)."""
        steps = [self.shoal_round, self.hf_round]
        for step in steps if index % 2 == 0 else steps[::-1]:
            step(index)

    def shoal_round(self, index: int) -> None:
        self.record("shoal", run_shoal(self.shoal, self.work, f"round{index}-"))

    def hf_round(self, index: int) -> None:
        if self.hf is None:
            return
        for batch in self.batches if index == 0 else [self.best_batch()]:
            self.record(
                f"hf_static_{batch}", run_hf_static(self.hf, self.work, batch, self.args.device)
            )
        if self.cb is not None:
            self.record(
                "hf_continuous", run_hf_continuous(self.hf, self.work, self.cb, self.args.device)
            )

    def record(self, mode: str, run: dict) -> None:
        self.runs.setdefault(mode, []).append(run)
        print(f"  {mode:<16} {run['tokens']:6d} tokens in {run['seconds']:7.2f} s", flush=True)


# ----- report


def figures(sides: Sides, num_params: int) -> dict:
    """The JSON line: best round of every mode; ``ratio`` is shoal over the faster transformers
    mode (static at its best batch size, or continuous batching)."""
    args, runs = sides.args, sides.runs
    shoal = fastest(runs["shoal"])
    shoal_tok_s = tok_s(shoal)
    static_tok_s = {b: tok_s(fastest(runs[f"hf_static_{b}"])) for b in sides.batches if sides.hf}
    best_batch = sides.best_batch() if static_tok_s else None
    cb_tok_s = tok_s(fastest(runs["hf_continuous"])) if "hf_continuous" in runs else None
    hf_modes = [x for x in (static_tok_s.get(best_batch or 0), cb_tok_s) if x is not None]
    hf_best = max(hf_modes) if hf_modes else None
    return {
        "shoal_tok_s": round(shoal_tok_s, 1),
        "hf_tok_s": round(static_tok_s[best_batch], 1) if best_batch else None,
        "hf_batch_best": best_batch,
        "hf_cb_tok_s": round(cb_tok_s, 1) if cb_tok_s else None,
        "hf_best_tok_s": round(hf_best, 1) if hf_best else None,
        "hf_best_mode": None
        if hf_best is None
        else "continuous"
        if hf_best == cb_tok_s
        else "static",
        "ratio": round(shoal_tok_s / hf_best, 3) if hf_best else None,
        "hf_batch_tok_s": {str(b): round(v, 1) for b, v in static_tok_s.items()},
        "engine_overhead_pct": round(
            100 * (shoal["step_s"] - shoal["forward_s"]) / shoal["step_s"], 2
        ),
        "shoal_steps": shoal["steps"],
        "step_s": round(shoal["step_s"], 3),
        "forward_s": round(shoal["forward_s"], 3),
        "model": sides.model.name,
        "num_params": num_params,
        "num_prompts": len(sides.work[0]),
        "tokens": sum(sides.work[1]),
        "device": args.device,
        "dtype": args.dtype,
        "hf_batches": sides.batches,
        "threads": args.threads,
        "rounds": args.rounds,
        "warmed_up": sides.warmed_up,
        "rounds_per_mode": {mode: len(mode_runs) for mode, mode_runs in runs.items()},
    }


def report(out: dict, work: Workload) -> None:
    prompts, max_tokens = work
    print(
        f"model: {out['model']}, {out['num_params'] / 1e6:.1f}M params, {out['dtype']} on "
        f"{out['device']}; {len(prompts)} prompts of {min(map(len, prompts))}.."
        f"{max(map(len, prompts))} tokens, {sum(max_tokens)} output tokens requested; "
        f"best of {out['rounds']} round(s) after a warm-up"
    )
    print(
        f"shoal:                     {out['shoal_tok_s']:8.1f} tok/s ({out['shoal_steps']} steps)"
    )
    for batch, value in out["hf_batch_tok_s"].items():
        print(f"transformers static b={batch:<3}: {value:8.1f} tok/s (left padded)")
    if out["hf_cb_tok_s"] is not None:
        print(f"transformers continuous:   {out['hf_cb_tok_s']:8.1f} tok/s (paged, sdpa)")
    if out["ratio"] is not None:
        print(f"ratio shoal/best transformers ({out['hf_best_mode']}): {out['ratio']:.2f}x")
    print(
        f"engine step time {out['step_s']:.2f} s vs bare forward {out['forward_s']:.2f} s: "
        f"overhead {out['engine_overhead_pct']:.1f}%"
    )
    print(json.dumps(out))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--model",
        default=None,
        help="default (the default model), a built-in name, a Hugging Face directory or a GGUF "
        "file (default: a random Llama built here)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument(
        "--hf-batches",
        default="8,16,32,64",
        type=lambda text: [int(x) for x in text.split(",")],
        help="static batch sizes swept for transformers' generate() (best kept)",
    )
    parser.add_argument("--hf-cb-page-size", type=int, default=256, help="its default page size")
    parser.add_argument("--batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--kv-bytes",
        type=int,
        default=None,
        help="shoal's KV cache (default: 512 MiB, or the whole workload's KV if more)",
    )
    parser.add_argument("--quick", action="store_true", help="short prompts and outputs, 1 round")
    parser.add_argument("--tiny", action="store_true", help="a ~0.6M-parameter model (smoke tests)")
    parser.add_argument("--skip-hf", action="store_true", help="shoal only")
    parser.add_argument(
        "--skip-hf-cb",
        dest="hf_cb",
        action="store_false",
        help="no continuous-batching baseline",
    )
    parser.add_argument(
        "--rounds",
        "--repeat",
        type=int,
        default=None,
        help="timed rounds per side after one warm-up, alternating, best kept (default 3; "
        "1 with --quick)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads for both systems (1: fastest on a shared box)",
    )
    args = parser.parse_args(argv)
    if args.tiny and args.model is not None:
        parser.error("--tiny sizes the random Llama: not with --model")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    args.rounds = max(1, args.rounds)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            model, num_params = random_model(Path(tmp), args)
        else:
            model, num_params = named_model(args.model), None
        work = workload(args.num_prompts, args.quick, model.vocab_size, model.max_len)
        sides = Sides(model, args, work)
        num_params = num_params if num_params is not None else shoal_params(sides.shoal)
        sides.warm_up()
        for index in range(args.rounds):
            print(f"round {index}:", flush=True)
            sides.run_round(index)
    report(figures(sides, num_params), work)


if __name__ == "__main__":
    main()
