"""Disaggregated prefill against colocated engine cores (issue 33): decode streams run while long
prompts arrive at a Poisson rate, on 1 prefill + 1 decode engine core and on 2 colocated ones
(DP=2, load routing), the same processes and threads (each actor a supervised process on a
local nats-server, each worker one thread).

A long prompt prefilled beside running decodes stalls them for its chunks; on a prefill engine
core it does not, and the decode engine core only pulls its KV. Measured per mode: the decode
streams' inter-token latency (p50/p99 over every gap), the long prompts' time to first token,
how many gaps stalled past the objective, and goodput: requests per second meeting their
objective over the run (which ends when the last long prompt is answered, so a mode that
answers them later runs longer) and the share of requests meeting it (a stream request: no gap
above ``--itl-slo-ms``; a long prompt: its first token within ``--ttft-slo-ms``). Targets: ITL p99
<= 0.5x colocated, TTFT p50 <= 1.5x, goodput >= 1.5x. The model is a random Llama of ~25M
parameters (``bench.throughput.build_model``; ``--tiny`` ~0.6M for a smoke run).

    .venv/bin/python bench/disagg.py [--quick] [--tiny] [--streams 4] [--long-prompts 8]
    shoal bench disagg ...

The last line printed is one JSON object: ``itl_p99_ms``, ``itl_p50_ms``, ``ttft_p50_ms`` and
``goodput`` per mode, their ratios (disagg over colocated), ``transfer_gbps`` (the decode
workers' pull rate), the objectives and the workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("colocated", "disagg")
STARTUP_TIMEOUT_S = 600.0


@dataclass
class Timed:
    """One request as its caller saw it: when it was sent and when each output arrived."""

    kind: str  # "stream" or "long"
    sent: float
    arrivals: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] - self.sent

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


@dataclass
class ModeRun:
    requests: list[Timed]
    seconds: float
    stats: dict[str, Any]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed_request(client: Any, prompt: list[int], max_tokens: int, kind: str) -> Timed:
    from shoal.bus.messages.sampling import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    timed = Timed(kind, time.perf_counter())
    async for _ in client.generate(prompt, params, f"{kind}-{uuid.uuid4().hex[:10]}"):
        timed.arrivals.append(time.perf_counter())
    return timed


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


async def run_workload(client: Any, args: argparse.Namespace, seed: int) -> list[Timed]:
    """Decode streams back to back until every long prompt is answered, and the long prompts
    at Poisson arrivals from one second in."""
    from bench.throughput import VOCAB

    rng = random.Random(seed)
    longs_done = asyncio.Event()
    results: list[Timed] = []

    async def stream(index: int) -> None:
        for _ in range(args.max_stream_requests):
            prompt = random_prompt(rng, args.stream_prompt_len, VOCAB)
            results.append(await timed_request(client, prompt, args.stream_tokens, "stream"))
            if longs_done.is_set():
                return

    async def longs() -> None:
        await asyncio.sleep(1.0)
        pending = []
        for _ in range(args.long_prompts):
            length = rng.randint(args.long_min, args.long_max)
            prompt = random_prompt(rng, length, VOCAB)
            pending.append(asyncio.ensure_future(timed_request(client, prompt, 16, "long")))
            await asyncio.sleep(rng.expovariate(args.rate))
        results.extend(await asyncio.gather(*pending))
        longs_done.set()

    await asyncio.gather(longs(), *(stream(i) for i in range(args.streams)))
    return results


def engine_config(model_dir: Path, args: argparse.Namespace, mode: str) -> Any:
    from shoal.deploy.deployment import build_config

    roles: dict[str, Any] = (
        {"data_parallel_size": 2, "routing_mode": "load"}
        if mode == "colocated"
        else {
            "num_prefill": 1,
            "num_decode": 1,
            "max_local_prefill_length": args.stream_prompt_len * 2,
            "max_prefill_queue_size": args.long_prompts,
        }
    )
    return build_config(
        model=str(model_dir),
        max_model_len=args.max_model_len,
        num_gpu_blocks_override=args.num_blocks,
        max_num_seqs=args.streams + args.long_prompts + 2,
        namespace=f"bench-disagg-{uuid.uuid4().hex[:8]}",
        **roles,
    )


async def run_mode(model_dir: Path, args: argparse.Namespace, mode: str) -> ModeRun:
    from bench.throughput import VOCAB
    from bench.throughput_e2e import start_supervised
    from shoal.engine.client.engine_client import AsyncEngineClient

    config = engine_config(model_dir, args, mode)
    async with AsyncExitStack() as stack:
        bus, _ = await start_supervised(stack, config, env={"OMP_NUM_THREADS": "1"})
        client = AsyncEngineClient(bus, config)
        stack.push_async_callback(client.close)
        await client.start()
        await client.wait_until_ready(STARTUP_TIMEOUT_S, num_engines=2)
        rng = random.Random(-1)  # warm-up: one of each kind, not measured
        await asyncio.gather(
            timed_request(client, random_prompt(rng, args.long_min, VOCAB), 4, "long"),
            timed_request(client, random_prompt(rng, args.stream_prompt_len, VOCAB), 4, "stream"),
        )
        started = time.perf_counter()
        requests = await run_workload(client, args, seed=args.seed)
        seconds = time.perf_counter() - started
        stats = pull_stats(client)
    return ModeRun(requests, seconds, stats)


def pull_stats(client: Any) -> dict[str, Any]:
    """What the engine cores last published of their handovers (summed over them)."""
    views = client.router.engines.values()
    total = {
        "kv_pulls": sum(v.stats.stats.kv_pulls for v in views),
        "kv_pull_failures": sum(v.stats.stats.kv_pull_failures for v in views),
        "kv_pulled_tokens": sum(v.stats.stats.kv_pulled_tokens for v in views),
        "kv_pull_bytes": sum(v.stats.stats.kv_pull_bytes for v in views),
        "kv_pull_time_s": sum(v.stats.stats.kv_pull_time_s for v in views),
        "remote_prefills": client.disagg.num_remote,
    }
    return total


def mode_figures(run: ModeRun, args: argparse.Namespace) -> dict[str, Any]:
    streams = [r for r in run.requests if r.kind == "stream"]
    longs = [r for r in run.requests if r.kind == "long"]
    gaps = [g for r in streams for g in r.gaps_s]
    met = sum(max(r.gaps_s, default=0.0) * 1000 <= args.itl_slo_ms for r in streams)
    met += sum(r.ttft_s * 1000 <= args.ttft_slo_ms for r in longs)
    return {
        "itl_p50_ms": round(1000 * statistics.median(gaps), 2),
        "itl_p99_ms": round(1000 * percentile(gaps, 0.99), 2),
        "itl_p999_ms": round(1000 * percentile(gaps, 0.999), 2),
        "itl_max_ms": round(1000 * max(gaps), 2),
        "stalled_gaps": sum(g * 1000 > args.itl_slo_ms for g in gaps),
        "ttft_p50_ms": round(1000 * statistics.median(r.ttft_s for r in longs), 1),
        "goodput": round(met / run.seconds, 4),
        "slo_attainment": round(met / max(len(streams) + len(longs), 1), 4),
        "num_stream_requests": len(streams),
        "num_long_prompts": len(longs),
        "num_met_slo": met,
        "seconds": round(run.seconds, 2),
        **run.stats,
    }


def report(figures: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"workload: {args.streams} decode streams ({args.stream_prompt_len}-token prompts, "
        f"{args.stream_tokens} tokens), {args.long_prompts} long prompts of "
        f"{args.long_min}-{args.long_max} tokens at {args.rate}/s; objectives: ITL <= "
        f"{args.itl_slo_ms} ms, TTFT <= {args.ttft_slo_ms} ms"
    )
    head = ("mode", "ITL p50", "ITL p99", "ITL p99.9", "ITL max", "stalls", "TTFT p50")
    head += ("goodput", "met", "pulls")
    print("".join(f"{h:>11}" for h in head))
    for mode, f in figures.items():
        row = (mode, f["itl_p50_ms"], f["itl_p99_ms"], f["itl_p999_ms"], f["itl_max_ms"])
        row += (f["stalled_gaps"], f["ttft_p50_ms"], f["goodput"])
        row += (f"{f['num_met_slo']}/{f['num_stream_requests'] + f['num_long_prompts']}",)
        row += (f["kv_pulls"],)
        print("".join(f"{v:>11}" for v in row))
    co, dis = figures["colocated"], figures["disagg"]
    pull_s = dis["kv_pull_time_s"]
    out = {
        "itl_p99_ms": {m: f["itl_p99_ms"] for m, f in figures.items()},
        "itl_p50_ms": {m: f["itl_p50_ms"] for m, f in figures.items()},
        "itl_p999_ms": {m: f["itl_p999_ms"] for m, f in figures.items()},
        "itl_max_ms": {m: f["itl_max_ms"] for m, f in figures.items()},
        "stalled_gaps": {m: f["stalled_gaps"] for m, f in figures.items()},
        "ttft_p50_ms": {m: f["ttft_p50_ms"] for m, f in figures.items()},
        "goodput": {m: f["goodput"] for m, f in figures.items()},
        "slo_attainment": {m: f["slo_attainment"] for m, f in figures.items()},
        "itl_p99_ratio": round(dis["itl_p99_ms"] / co["itl_p99_ms"], 3),
        "ttft_p50_ratio": round(dis["ttft_p50_ms"] / co["ttft_p50_ms"], 3),
        "goodput_ratio": round(dis["goodput"] / max(co["goodput"], 1e-9), 3),
        "transfer_gbps": round(dis["kv_pull_bytes"] * 8 / pull_s / 1e9, 2) if pull_s else None,
        "kv_pulls": dis["kv_pulls"],
        "kv_pull_failures": dis["kv_pull_failures"],
        "slo": {"itl_ms": args.itl_slo_ms, "ttft_ms": args.ttft_slo_ms},
        "workload": {
            "streams": args.streams,
            "stream_tokens": args.stream_tokens,
            "long_prompts": args.long_prompts,
            "long_tokens": [args.long_min, args.long_max],
            "rate": args.rate,
        },
    }
    print(
        f"disagg/colocated: ITL p99 {out['itl_p99_ratio']} (target <= 0.5), TTFT p50 "
        f"{out['ttft_p50_ratio']} (<= 1.5), goodput {out['goodput_ratio']} (>= 1.5); "
        f"pulls at {out['transfer_gbps']} Gbit/s"
    )
    print(json.dumps(out))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter prompts, fewer of them")
    parser.add_argument("--tiny", action="store_true", help="a ~0.6M-parameter model (smoke)")
    parser.add_argument("--streams", type=int, default=4, help="decode streams at once")
    parser.add_argument("--stream-prompt-len", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--max-stream-requests", type=int, default=20, help="per stream")
    parser.add_argument("--long-prompts", type=int, default=8)
    parser.add_argument("--long-min", type=int, default=2048)
    parser.add_argument("--long-max", type=int, default=4096)
    parser.add_argument("--rate", type=float, default=0.25, help="long prompts per second")
    parser.add_argument("--itl-slo-ms", type=float, default=150.0)
    parser.add_argument("--ttft-slo-ms", type=float, default=15000.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.long_prompts, args.long_min, args.long_max = 3, 512, 1024
        args.stream_tokens, args.rate = 96, 1.0
    args.max_model_len = 1 << (args.long_max + 64).bit_length()
    per_request = args.max_model_len // 16
    args.num_blocks = 2 * (args.streams + args.long_prompts + 2) * per_request
    return args


async def main_async(args: argparse.Namespace) -> None:
    from bench.throughput import VOCAB, build_model
    from bench.throughput_e2e import save_tokenizer

    figures: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-disagg-") as tmp:
        model_dir = Path(tmp) / "model"
        build_model(model_dir, "float32", args.tiny, args.max_model_len)
        save_tokenizer(model_dir, VOCAB)
        for mode in MODES:
            figures[mode] = mode_figures(await run_mode(model_dir, args, mode), args)
    report(figures, args)


def main(argv: list[str] | None = None) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"  # actor processes inherit it
    import torch

    torch.set_num_threads(1)
    asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    main()
