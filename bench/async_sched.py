"""Async scheduling on and off: the same decode-heavy workload through two NATS deployments (worker
and engine core in their own processes, the supervisor runs them; the engine client in this
process), one with ``async_scheduling`` and one without, both up at once.

Models: the built-in demo model (small: host overhead is a large share of a step) and the random
~23M Llama of ``bench/throughput.py`` (``--tiny``: its ~0.6M variant, for smoke tests). Workload:
``--num-prompts`` prompts of ``--prompt-len`` random tokens, ``--max-tokens`` greedy output
tokens each (eos ignored), all submitted at once. Each deployment gets one untimed warm-up, then
``--rounds`` timed runs each, alternating which goes first, every round with shifted tokens (no
prefix-cache hits across rounds); the best round of each side is reported.

The worker's idle fraction is the worker's own measure (``SchedulerStats.worker_idle_s``: time
from handing back a result to starting the next step, while its engine core had work) over its
execute time (``worker_execute_s``), in percent. Target (issue 12): async ≥ 1.25× sync on the
demo model, and the worker idle < 10% of its busy time with async on.

    .venv/bin/python bench/async_sched.py [--quick] [--models demo,llama] [--threads 1]
    shoal bench async_sched [--quick] ...

The last line printed is one JSON object: ``async_tok_s``, ``sync_tok_s``, ``ratio``,
``worker_idle_pct_async``, ``worker_idle_pct_sync`` of the first model, and ``models`` with the
figures of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIDES = ("async", "sync")
FIRST_TOKEN = 3


@dataclass(frozen=True)
class Run:
    """One timed round of one deployment (differences of the engine core's cumulative stats)."""

    tokens: int
    seconds: float
    execute_s: float
    idle_s: float
    num_steps: int
    max_in_flight: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def idle_pct(self) -> float:
        return 100.0 * self.idle_s / max(self.execute_s, 1e-9)


class LatestStats:
    """The engine core's latest stats (the most steps seen), fed by the client's listener."""

    def __init__(self) -> None:
        self.stats: Any = None

    def on_stats(self, stats: Any, engine_id: str) -> None:
        if self.stats is None or stats.num_worker_steps >= self.stats.num_worker_steps:
            self.stats = stats

    def totals(self) -> tuple[float, float, int]:
        s = self.stats
        return (
            (0.0, 0.0, 0)
            if s is None
            else (s.worker_execute_s, s.worker_idle_s, s.num_worker_steps)
        )


def make_workload(args: argparse.Namespace, vocab: int, round_index: int) -> tuple[list, list]:
    import torch

    gen = torch.Generator().manual_seed(1000 + round_index)
    prompts = [
        torch.randint(FIRST_TOKEN, vocab, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.num_prompts)
    ]
    return prompts, [args.max_tokens] * args.num_prompts


def engine_config(model_dir: Path, args: argparse.Namespace, async_on: bool) -> Any:
    from shoal.deploy.deployment import build_config

    block_size = 16
    per_request = -(-(args.prompt_len + args.max_tokens) // block_size) + 1
    return build_config(
        model=str(model_dir),
        dtype="float32",
        device=args.device,
        max_model_len=min(1024, args.prompt_len + args.max_tokens + 16),
        block_size=block_size,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=max(2048, args.num_prompts * args.prompt_len),
        num_gpu_blocks_override=args.num_prompts * per_request + 16,
        bus="nats",
        namespace=f"bench-async-{uuid.uuid4().hex[:8]}",
        async_scheduling=async_on,
    )


async def open_side(stack: AsyncExitStack, config: Any, threads: int) -> tuple[Any, LatestStats]:
    """A NATS deployment in processes (``bench/throughput_e2e.py``'s) and a client here."""
    from bench.throughput_e2e import open_nats

    client, _ = await open_nats(stack, config, threads)
    latest = LatestStats()
    client.stats_listeners.append(latest.on_stats)
    return client, latest


async def measure(client: Any, latest: LatestStats, workload: tuple, prefix: str) -> Run:
    from bench.throughput_e2e import generate_all

    exec0, idle0, steps0 = latest.totals()
    started = time.perf_counter()
    tokens = await generate_all(client, *workload, prefix)
    seconds = time.perf_counter() - started
    exec1, idle1, steps1 = latest.totals()
    max_in_flight = latest.stats.max_steps_in_flight if latest.stats is not None else 0
    return Run(tokens, seconds, exec1 - exec0, idle1 - idle0, steps1 - steps0, max_in_flight)


async def bench_model(model_dir: Path, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    from bench.throughput_e2e import generate_all

    runs: dict[str, list[Run]] = {side: [] for side in SIDES}
    async with AsyncExitStack() as stack:
        clients = {
            side: await open_side(
                stack, engine_config(model_dir, args, side == "async"), args.threads
            )
            for side in SIDES
        }
        warm_prompts, _ = make_workload(args, vocab, args.rounds)
        warm = (warm_prompts[:4], [4] * len(warm_prompts[:4]))
        for client, _ in clients.values():
            await generate_all(client, *warm, "warmup")
        for r in range(args.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for side in order:
                client, latest = clients[side]
                run = await measure(client, latest, make_workload(args, vocab, r), f"r{r}-")
                runs[side].append(run)
                print_run(f"round {r} {side}:", run)
    best = {side: max(runs[side], key=lambda run: run.tok_s) for side in SIDES}
    step_ms = {side: 1e3 * best[side].seconds / max(best[side].num_steps, 1) for side in SIDES}
    return {
        "async_tok_s": round(best["async"].tok_s, 1),
        "sync_tok_s": round(best["sync"].tok_s, 1),
        "ratio": round(best["async"].tok_s / best["sync"].tok_s, 3),
        "worker_idle_pct_async": round(best["async"].idle_pct, 2),
        "worker_idle_pct_sync": round(best["sync"].idle_pct, 2),
        "max_steps_in_flight": {side: best[side].max_in_flight for side in SIDES},
        "step_ms": {side: round(ms, 3) for side, ms in step_ms.items()},
        "tok_s_rounds": {side: [round(run.tok_s, 1) for run in runs[side]] for side in SIDES},
        "tokens": best["async"].tokens,
    }


def print_run(name: str, run: Run) -> None:
    steps = max(run.num_steps, 1)
    print(
        f"{name:<15} {run.tokens:6d} tokens in {run.seconds:6.2f} s = {run.tok_s:8.1f} tok/s "
        f"({run.num_steps} steps, {1e3 * run.seconds / steps:.2f} ms each; worker execute "
        f"{1e3 * run.execute_s / steps:.2f} ms, idle {1e3 * run.idle_s / steps:.2f} ms "
        f"= {run.idle_pct:.1f}% of busy)",
        flush=True,
    )


def demo_model() -> tuple[Path, int]:
    from shoal.workers.demo import ensure_demo_model
    from shoal.workers.demo.spec import DemoSpec

    return ensure_demo_model(), DemoSpec().vocab_size


def llama_model(tmp: Path, tiny: bool) -> tuple[Path, int, int]:
    from bench.throughput import VOCAB, build_model
    from bench.throughput_e2e import save_tokenizer

    num_params = build_model(tmp, "float32", tiny)
    save_tokenizer(tmp, VOCAB)
    return tmp, VOCAB, num_params


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default="demo,llama", help="comma-separated: demo, llama")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=None, help="timed runs per side (default 3)")
    parser.add_argument("--quick", action="store_true", help="8 prompts, 32 tokens, 1 round")
    parser.add_argument("--tiny", action="store_true", help="the ~0.6M Llama (smoke tests)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_tokens = min(args.num_prompts, 8), min(args.max_tokens, 32)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from bench.throughput_e2e import init_torch

    init_torch(args)
    models: dict[str, Any] = {}
    print(
        f"{args.num_prompts} prompts of {args.prompt_len} tokens, {args.max_tokens} greedy output "
        f"tokens each, all at once; NATS, worker and engine core in their own processes; "
        f"{args.threads} torch thread(s) per process on {args.device}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="shoal-bench-async-") as tmp:
        for name in args.models.split(","):
            if name == "demo":
                model_dir, vocab = demo_model()
                extra: dict[str, Any] = {}
            elif name == "llama":
                model_dir, vocab, num_params = llama_model(Path(tmp), args.tiny)
                extra = {"num_params": num_params}
            else:
                raise SystemExit(f"unknown model {name!r}: demo or llama")
            print(f"model {name}: {model_dir}", flush=True)
            figures = asyncio.run(bench_model(model_dir, vocab, args))
            models[name] = {**figures, **extra}
            print(
                f"{name}: async {figures['async_tok_s']} tok/s, sync {figures['sync_tok_s']} "
                f"tok/s, ratio {figures['ratio']} (target >= 1.25 on demo); worker idle "
                f"{figures['worker_idle_pct_async']}% async, {figures['worker_idle_pct_sync']}% "
                "sync (target < 10% async)",
                flush=True,
            )
    first = models[args.models.split(",")[0]]
    keys = ("async_tok_s", "sync_tok_s", "ratio", "worker_idle_pct_async", "worker_idle_pct_sync")
    out = {key: first[key] for key in keys}
    out.update(
        model=args.models.split(",")[0],
        models=models,
        num_prompts=args.num_prompts,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        threads=args.threads,
        device=args.device,
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
