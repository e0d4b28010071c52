"""Structured outputs' cost: one batch where half the requests carry a JSON schema against the
same batch with none, through the offline ``LLM`` (worker and engine core in this process, the
in-memory bus), and the per-step mask cost on its own.

Workload: ``--num-requests`` prompts of ``--prompt-len`` random tokens, ``--max-tokens`` output
tokens each (eos ignored), all submitted at once. The schema is an array of exactly
``SCHEMA_ITEMS`` enum strings, longer than any output here, so every constrained request is
masked at every step (none finishes its grammar early and frees its row). One untimed warm-up of
each side (the grammar compiles there, then comes from xgrammar's cache), then ``--rounds``
timed rounds, alternating which side goes first, each with fresh prompts; the best round of each
side is reported. Model: the built-in demo model (``--model DIR`` for another local checkpoint
with a tokenizer); a small model is the worst case for the mask's share of a step.

Mask cost per step (``mask_us_per_step``): the engine core filling the bitmask rows of
``num_requests / 2`` matchers (``XgrammarBackend.bitmask``) plus the worker applying them to
``num_requests`` rows of logits (``apply_grammar_bitmask``), timed apart over ``--mask-iters``
repetitions. Target (issue 19): at most 10% throughput loss at 64 running requests.

    .venv/bin/python bench/structured.py [--quick] [--num-requests 64] [--model DIR]
    shoal bench structured [--quick] ...

The last line printed is one JSON object: ``free_tok_s``, ``mixed_tok_s``, ``ratio`` (mixed /
free), ``mask_us_per_step``, ``fill_us_per_step``, ``apply_us_per_step``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA_ITEMS = 4096
SCHEMA = {
    "type": "array",
    "items": {"enum": ["alpha", "beta", "gamma", "delta"]},
    "minItems": SCHEMA_ITEMS,
    "maxItems": SCHEMA_ITEMS,
}
FIRST_TOKEN = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a local checkpoint (default: demo)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mask-iters", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on or off (default: the engine's default)",
    )
    parser.add_argument("--quick", action="store_true", help="16 requests, 32 tokens, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_tokens, args.rounds, args.mask_iters = 16, 32, 1, 50
    return args


def model_dir(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model)
    from shoal.workers.demo import ensure_demo_model

    return ensure_demo_model()


def requests(args: argparse.Namespace, vocab: int, round_index: int, mixed: bool) -> tuple:
    import torch

    from shoal import SamplingParams
    from shoal.bus.messages.structured import StructuredOutputsParams

    gen = torch.Generator().manual_seed(7000 + 2 * round_index + mixed)
    prompts = [
        {"prompt_token_ids": torch.randint(FIRST_TOKEN, vocab, (args.prompt_len,), generator=gen)}
        for _ in range(args.num_requests)
    ]
    for prompt in prompts:
        prompt["prompt_token_ids"] = prompt["prompt_token_ids"].tolist()
    common = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    schema = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [
        SamplingParams(**common, structured_outputs=schema if mixed and i % 2 else None)
        for i in range(args.num_requests)
    ]
    return prompts, params


def timed_batch(llm: Any, args: argparse.Namespace, vocab: int, round_index: int, mixed: bool):  # type: ignore[no-untyped-def]
    prompts, params = requests(args, vocab, round_index, mixed)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if mixed:  # the constrained outputs are prefixes of the schema's language
        for output, p in zip(outputs, params, strict=True):
            if p.structured_outputs is not None:
                assert output.outputs[0].text.startswith('["'), output.outputs[0].text[:40]
    return tokens / seconds


def throughput(path: Path, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    from shoal import LLM

    block_size = 16
    per_request = -(-(args.prompt_len + args.max_tokens) // block_size) + 1
    llm = LLM(
        str(path),
        max_num_seqs=args.num_requests,
        num_gpu_blocks_override=per_request * args.num_requests + 8,
        max_num_batched_tokens=max(2048, args.num_requests * args.prompt_len),
        **({} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling}),
    )
    try:
        timed_batch(llm, args, vocab, -1, mixed=False)  # warm-ups: the grammar compiles here
        timed_batch(llm, args, vocab, -1, mixed=True)
        best = {"free": 0.0, "mixed": 0.0}
        for round_index in range(args.rounds):
            order = [False, True] if round_index % 2 == 0 else [True, False]
            for mixed in order:
                tok_s = timed_batch(llm, args, vocab, round_index, mixed)
                side = "mixed" if mixed else "free"
                best[side] = max(best[side], tok_s)
        return best
    finally:
        llm.shutdown()


def mask_cost(path: Path, args: argparse.Namespace, vocab: int, eos: list[int]) -> dict[str, float]:
    import torch

    from shoal.bus.messages.structured import StructuredOutputsParams
    from shoal.engine.core.grammar import GrammarState
    from shoal.engine.structured.backend import XgrammarBackend
    from shoal.workers.grammar_mask import apply_grammar_bitmask

    backend = XgrammarBackend(str(path), vocab, eos)
    ids = [f"r{i}" for i in range(args.num_requests // 2)]
    schema = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    for request_id in ids:
        backend.start(request_id, schema, [])
    while any(backend.state(r)[0] is GrammarState.COMPILING for r in ids):
        time.sleep(0.01)
    started = time.perf_counter()
    for _ in range(args.mask_iters):
        bitmask = backend.bitmask(ids, {})
    fill_s = (time.perf_counter() - started) / args.mask_iters
    logits = torch.randn(args.num_requests, vocab)
    rows = {request_id: 2 * i + 1 for i, request_id in enumerate(ids)}
    started = time.perf_counter()
    for _ in range(args.mask_iters):
        apply_grammar_bitmask(logits, rows, bitmask)
    apply_s = (time.perf_counter() - started) / args.mask_iters
    backend.close()
    return {"fill_us_per_step": fill_s * 1e6, "apply_us_per_step": apply_s * 1e6}


def main(argv: list[str] | None = None) -> None:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    path = model_dir(args)
    config = json.loads((path / "config.json").read_text())
    vocab = int(config["vocab_size"])
    eos = config.get("eos_token_id", [])
    eos = eos if isinstance(eos, list) else [eos]
    print(
        f"{args.num_requests} requests ({args.num_requests // 2} with a JSON schema in the mixed "
        f"batch), {args.prompt_len}-token prompts, {args.max_tokens} greedy tokens each; "
        f"model {path.name} (vocab {vocab}); {args.threads} torch thread(s); best of "
        f"{args.rounds} round(s)"
    )
    best = throughput(path, args, vocab)
    cost = mask_cost(path, args, vocab, eos)
    ratio = best["mixed"] / best["free"]
    print(f"{'batch':<8}{'tok/s':>10}")
    print(f"{'free':<8}{best['free']:>10.1f}")
    print(f"{'mixed':<8}{best['mixed']:>10.1f}")
    mask_us = cost["fill_us_per_step"] + cost["apply_us_per_step"]
    print(
        f"mixed/free {ratio:.3f} (target >= 0.90); mask per step {mask_us:.0f} us "
        f"(engine core fill {cost['fill_us_per_step']:.0f} us for {args.num_requests // 2} rows, "
        f"worker apply {cost['apply_us_per_step']:.0f} us)"
    )
    out = {
        "free_tok_s": round(best["free"], 1),
        "mixed_tok_s": round(best["mixed"], 1),
        "ratio": round(ratio, 4),
        "mask_us_per_step": round(mask_us, 1),
        "fill_us_per_step": round(cost["fill_us_per_step"], 1),
        "apply_us_per_step": round(cost["apply_us_per_step"], 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
