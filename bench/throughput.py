"""Offline generation throughput: shoal (real scheduler + model runner) against transformers'
``generate()`` on the same random Llama of about 25M parameters.

64 prompts of 32..512 random tokens, max_tokens drawn per request from 16..256 (seed 0), greedy,
eos ignored. transformers gets the same prompts in left-padded batches of ``--hf-batch`` (16 by
default), grouped by max_tokens so each batch wastes few steps; it is credited only with the
tokens each request asked for. shoal's engine overhead is the share of its step time (schedule +
diff + input building + sampling + output update) spent outside the bare model forward.

    .venv/bin/python bench/throughput.py [--device cpu|cuda] [--dtype float32] [--quick]
        [--repeat N]

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal.bus.messages.config import ShoalConfig
from shoal.bus.messages.sampling import SamplingParams
from shoal.engine.core.request import Request
from shoal.engine.core.scheduler import Scheduler
from shoal.workers.model_runner import ModelRunner

VOCAB = 4096
MAX_MODEL_LEN = 1024


def build_model(out_dir: Path, dtype: str) -> int:
    """A random Llama of ~25M parameters saved with save_pretrained; returns its size."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=MAX_MODEL_LEN,
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


def workload(num_prompts: int, quick: bool) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(0)
    hi_len, hi_out = (128, 32) if quick else (512, 256)
    lengths = torch.randint(32, hi_len + 1, (num_prompts,), generator=gen).tolist()
    max_tokens = torch.randint(16, hi_out + 1, (num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    return prompts, max_tokens


def run_shoal(model_dir: Path, prompts, max_tokens, args) -> dict:  # type: ignore[no-untyped-def]
    config = ShoalConfig.from_options(
        model=str(model_dir),
        dtype=args.dtype,
        device=args.device,
        block_size=16,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=args.batched_tokens,
        kv_cache_memory_bytes=args.kv_bytes,
    )
    runner = ModelRunner(config)
    facts = runner.load()
    scheduler = Scheduler(
        config.scheduler_config,
        config.cache_config,
        num_blocks=facts.num_blocks,
        max_model_len=facts.max_model_len,
    )
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        scheduler.add_request(
            Request(f"r{i}", prompt, params, client_id="bench", arrival_time=float(i))
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


def run_hf(model_dir: Path, prompts, max_tokens, args) -> dict:  # type: ignore[no-untyped-def]
    import transformers

    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, args.dtype)
        )
        .to(args.device)
        .eval()
    )
    model.generation_config.eos_token_id = None
    order = sorted(range(len(prompts)), key=lambda i: max_tokens[i])
    started = time.perf_counter()
    for begin in range(0, len(order), args.hf_batch):
        chunk = order[begin : begin + args.hf_batch]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, i in enumerate(chunk):  # left padding
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        with torch.inference_mode():
            model.generate(
                ids.to(args.device),
                attention_mask=mask.to(args.device),
                do_sample=False,
                max_new_tokens=max(max_tokens[i] for i in chunk),
                pad_token_id=0,
            )
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return {"tokens": sum(max_tokens), "seconds": time.perf_counter() - started}


def fastest(best: dict | None, run: dict) -> dict:
    return run if best is None or run["seconds"] < best["seconds"] else best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-bytes", type=int, default=512 * 1024 * 1024)
    parser.add_argument("--quick", action="store_true", help="short prompts and outputs")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run both systems this many times, alternating, and keep each one's fastest run "
        "(damps a noisy machine)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads for both systems (1: fastest on a shared box)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts, max_tokens = workload(args.num_prompts, args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        num_params = build_model(model_dir, args.dtype)
        shoal, hf = None, None
        for _ in range(max(1, args.repeat)):
            shoal = fastest(shoal, run_shoal(model_dir, prompts, max_tokens, args))
            if not args.skip_hf:
                hf = fastest(hf, run_hf(model_dir, prompts, max_tokens, args))
        assert shoal is not None
    shoal_tok_s = shoal["tokens"] / shoal["seconds"]
    hf_tok_s = hf["tokens"] / hf["seconds"] if hf else None
    overhead = 100.0 * (shoal["step_s"] - shoal["forward_s"]) / shoal["step_s"]
    print(
        f"model: random Llama, {num_params / 1e6:.1f}M params, {args.dtype} on {args.device}; "
        f"{len(prompts)} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
        f"{sum(max_tokens)} output tokens requested"
    )
    print(
        f"shoal:        {shoal['tokens']:6d} tokens in {shoal['seconds']:7.2f} s = "
        f"{shoal_tok_s:8.1f} tok/s ({shoal['steps']} steps)"
    )
    if hf is not None:
        print(
            f"transformers: {hf['tokens']:6d} tokens in {hf['seconds']:7.2f} s = "
            f"{hf_tok_s:8.1f} tok/s (batches of {args.hf_batch}, left padded)"
        )
        print(f"ratio shoal/transformers: {shoal_tok_s / hf_tok_s:.2f}x")  # type: ignore[operator]
    print(
        f"engine step time {shoal['step_s']:.2f} s vs bare forward {shoal['forward_s']:.2f} s: "
        f"overhead {overhead:.1f}%"
    )
    print(
        json.dumps(
            {
                "shoal_tok_s": round(shoal_tok_s, 1),
                "hf_tok_s": round(hf_tok_s, 1) if hf_tok_s else None,
                "ratio": round(shoal_tok_s / hf_tok_s, 3) if hf_tok_s else None,
                "engine_overhead_pct": round(overhead, 2),
                "shoal_steps": shoal["steps"],
                "step_s": round(shoal["step_s"], 3),
                "forward_s": round(shoal["forward_s"], 3),
                "num_params": num_params,
                "device": args.device,
                "dtype": args.dtype,
                "hf_batch": args.hf_batch,
                "threads": args.threads,
                "repeat": args.repeat,
            }
        )
    )


if __name__ == "__main__":
    main()
