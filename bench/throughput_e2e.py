"""End-to-end throughput through the full actor path: the workload of ``bench/throughput.py``
(its random ~25M Llama, 64 prompts of 32..512 tokens, 16..256 greedy output tokens each, eos
ignored) served by engine client → engine core → worker over two buses, beside transformers'
``generate()`` in one run:

- nats:   a local nats-server, the worker and the engine core in their own processes (the
          supervisor runs them), the engine client in this process;
- memory: the in-memory bus, every actor in this process (as the offline ``LLM`` runs).

Both stacks start first and transformers loads its model in this process (startup is not
timed); each of the three gets the same untimed warm-up (the first ``--hf-batch`` prompts, 4
output tokens each). Then each runs the workload ``--rounds`` times (3; 1 with ``--quick``),
rotating which goes first, every round with its tokens shifted so no round hits an earlier
round's prefix cache; the best round of each is reported (this machine is shared and noisy).
transformers runs ``generate()`` on left-padded batches of ``--hf-batch`` in a worker thread of
this process, so the stacks' event loop stays live (heartbeats) while it computes;
``bench/throughput.py`` sweeps its batch size and adds its continuous-batching mode. The JSON
says how many processes each side used (``processes``) and the torch threads of each.

A shoal round submits every request at once and runs from the first submit to the last final
output; tokens are counted from the final outputs. The engine core reports its cumulative step
wall time (step sent → result back) and the workers' own execute time: their difference per step
is the cost of the bus and the worker shell, and the NATS figure minus the in-memory one is what
NATS adds. Target: NATS within 10% of the in-memory path's throughput.

    .venv/bin/python bench/throughput_e2e.py [--quick] [--device cpu|cuda] [--threads 1]
    shoal bench throughput [--quick] ...

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FIRST_TOKEN = 3  # workload() draws prompt tokens from [3, VOCAB)
RUN_TIMEOUT_S = 3600.0
STARTUP_TIMEOUT_S = 600.0


Workload = tuple[list[list[int]], list[int]]


@dataclass(frozen=True)
class HfRun:
    """One timed transformers round: the tokens the requests asked for and the wall time."""

    tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class PathRun:
    """One shoal path's figures over the timed workload (differences of cumulative stats)."""

    tokens: int
    seconds: float
    num_steps: int
    step_wall_s: float  # engine core: step sent → result back, summed
    execute_s: float  # workers' own execute time, summed
    num_preemptions: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def bus_step_us(self) -> float:
        """Per step: round trip at the engine core minus the worker's execute time."""
        return 1e6 * (self.step_wall_s - self.execute_s) / max(self.num_steps, 1)


class StepTimes:
    """The latest cumulative stats of each engine core, fed by the client's stats listeners."""

    def __init__(self) -> None:
        self.latest: dict[str, Any] = {}  # engine id → SchedulerStats

    def on_stats(self, stats: Any, engine_id: str) -> None:
        current = self.latest.get(engine_id)
        if current is None or stats.num_worker_steps >= current.num_worker_steps:
            self.latest[engine_id] = stats

    def totals(self) -> tuple[float, float, int, int]:
        """(step wall s, worker execute s, steps, preemptions) over every engine core."""
        stats = list(self.latest.values())
        return (
            sum(s.step_wall_s for s in stats),
            sum(s.worker_execute_s for s in stats),
            sum(s.num_worker_steps for s in stats),
            sum(s.num_preemptions for s in stats),
        )


# ----- the model directory and the engine arguments


def save_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the whole vocabulary (ids 0, 1, 2: pad, bos, eos as in
    ``build_model``'s config). The engine client needs one to start; prompts go in as ids and
    nothing is detokenized."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(model_dir))


def blocks_needed(prompts: list[list[int]], max_tokens: list[int], block_size: int) -> int:
    """KV blocks for every request at its full length at once, so nothing is preempted."""
    return sum(-(-(len(p) + m) // block_size) for p, m in zip(prompts, max_tokens, strict=True))


def engine_config(model_dir: Path, args: argparse.Namespace, bus: str) -> Any:
    from bench.throughput import MAX_MODEL_LEN
    from shoal.deploy.deployment import build_config

    return build_config(
        model=str(model_dir),
        dtype=args.dtype,
        device=args.device,
        max_model_len=MAX_MODEL_LEN,
        block_size=args.block_size,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=args.batched_tokens,
        num_gpu_blocks_override=args.num_blocks,
        enable_prefix_caching=True,
        bus=bus,
        namespace=f"bench-{uuid.uuid4().hex[:8]}",
    )


# ----- the workload through an engine client


async def generate_all(
    client: Any, prompts: list[list[int]], max_tokens: list[int], prefix: str
) -> int:
    """Submit every request at once, wait for every final output; the output tokens."""
    from shoal.bus.messages.sampling import OutputKind, SamplingParams

    collectors = []
    for i, (prompt, num) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=num,
            ignore_eos=True,
            detokenize=False,
            output_kind=OutputKind.FINAL_ONLY,
        )
        collectors.append(await client.add_request(prompt, params, f"{prefix}{i}"))
    total = 0
    for i, collector in enumerate(collectors):
        final = await collector.get()
        while not final.finished:
            final = await collector.get()
        completion = final.outputs[0]
        if completion.finish_reason != "length" or len(completion.token_ids) != max_tokens[i]:
            raise RuntimeError(
                f"request {prefix}{i}: {completion.finish_reason} after "
                f"{len(completion.token_ids)} of {max_tokens[i]} tokens ({final.error})"
            )
        total += len(completion.token_ids)
    return total


async def measure(
    client: Any, times: StepTimes, workload: tuple[list[list[int]], list[int]], prefix: str
) -> PathRun:
    """Time the whole workload on a warmed-up stack."""
    wall0, exec0, steps0, preempt0 = times.totals()
    started = time.perf_counter()
    tokens = await asyncio.wait_for(generate_all(client, *workload, prefix), RUN_TIMEOUT_S)
    seconds = time.perf_counter() - started
    wall1, exec1, steps1, preempt1 = times.totals()
    return PathRun(
        tokens, seconds, steps1 - steps0, wall1 - wall0, exec1 - exec0, preempt1 - preempt0
    )


async def ready_client(stack: AsyncExitStack, bus: Any, config: Any) -> tuple[Any, StepTimes]:
    """An engine client on ``bus``, closed with ``stack``, once one warm-up request went through."""
    from shoal.engine.client.engine_client import AsyncEngineClient

    client = AsyncEngineClient(bus, config)
    times = StepTimes()
    client.stats_listeners.append(times.on_stats)
    stack.push_async_callback(client.close)
    await client.start()
    await client.wait_until_ready(STARTUP_TIMEOUT_S)
    return client, times


async def open_nats(stack: AsyncExitStack, config: Any, threads: int) -> tuple[Any, StepTimes]:
    """Worker and engine core as supervised processes on a fresh local nats-server."""
    bus, _ = await start_supervised(stack, config, env={"OMP_NUM_THREADS": str(threads)})
    return await ready_client(stack, bus, config)


async def start_supervised(
    stack: AsyncExitStack,
    config: Any,
    *,
    env: dict[str, str] | None = None,
    actor_kwargs: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """A fresh local nats-server, every planned actor a supervised process on it (with
    ``actor_kwargs`` added to each), and a bus here; (bus, supervisor), closed with ``stack``."""
    from shoal.bus import connect_bus
    from shoal.bus.nats_ops.server import NatsServer
    from shoal.bus.runtime.supervisor import ActorSpec, Supervisor
    from shoal.deploy.deployment import plan_actors

    server = stack.enter_context(NatsServer())
    specs = [
        ActorSpec(
            p.name, p.target, server.url, {**p.kwargs, **(actor_kwargs or {})}, env=env or {},
            kind=p.kind,
        )
        for p in plan_actors(config)
    ]  # fmt: skip
    bus = await connect_bus(server.url)
    stack.push_async_callback(bus.close)
    supervisor = Supervisor(specs, status_bus=bus, namespace=config.bus_config.namespace)
    stack.push_async_callback(supervisor.stop)
    await supervisor.start()
    return bus, supervisor


async def open_memory(stack: AsyncExitStack, config: Any) -> tuple[Any, StepTimes]:
    """Every actor in this process on the in-memory bus (the offline ``LLM``'s stack)."""
    from shoal.bus import connect_bus
    from shoal.deploy.deployment import plan_actors, start_in_process, stop_in_process

    bus = await connect_bus(f"memory://{config.bus_config.namespace}")
    stack.push_async_callback(bus.close)
    actors = await start_in_process(bus, plan_actors(config))
    stack.push_async_callback(stop_in_process, actors)
    return await ready_client(stack, bus, config)


def round_prompts(prompts: list[list[int]], round_index: int, vocab: int) -> list[list[int]]:
    """The same lengths with every token shifted by the round, so no round hits the prefix
    cache that an earlier round on the same engine core filled."""
    shift = round_index * 7919
    return [
        [FIRST_TOKEN + (t - FIRST_TOKEN + shift) % (vocab - FIRST_TOKEN) for t in p]
        for p in prompts
    ]


async def run_hf_round(model: Any, workload: Workload, args: argparse.Namespace) -> HfRun:
    """transformers' static batches in a worker thread (the event loop keeps serving)."""
    from bench.throughput import run_hf_static

    run = await asyncio.to_thread(run_hf_static, model, workload, args.hf_batch, args.device)
    return HfRun(run["tokens"], run["seconds"])


async def run_rounds(
    args: argparse.Namespace, model_dir: Path, workload: Workload
) -> tuple[dict[str, list[PathRun]], list[HfRun], list[str]]:
    """Both stacks and transformers up at once, one warm-up each, then ``rounds`` timed runs of
    each, rotating which goes first; the timed runs and the sides that had their warm-up."""
    from bench.throughput import load_hf, warmup_workload

    prompts, max_tokens = workload
    runs: dict[str, list[PathRun]] = {"nats": [], "memory": []}
    hf_runs: list[HfRun] = []
    warmed_up: list[str] = []
    async with AsyncExitStack() as stack:
        nats_args = engine_config(model_dir, args, "nats")
        memory_args = engine_config(model_dir, args, "memory")
        clients = {
            "nats": await open_nats(stack, nats_args, args.threads),
            "memory": await open_memory(stack, memory_args),
        }
        model = None if args.skip_hf else await asyncio.to_thread(load_hf, model_dir, args)
        warm = warmup_workload(
            (round_prompts(prompts, args.rounds, args.vocab), max_tokens), args.hf_batch
        )
        for side, (client, _) in clients.items():
            await generate_all(client, *warm, "warmup")
            warmed_up.append(side)
        if model is not None:
            await run_hf_round(model, warm, args)
            warmed_up.append("hf")
        sides = ["nats", "memory"] + ([] if model is None else ["hf"])
        for r in range(args.rounds):
            shifted = (round_prompts(prompts, r, args.vocab), max_tokens)
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                if side == "hf":
                    hf_runs.append(await run_hf_round(model, shifted, args))
                    print_hf(f"round {r} hf:", hf_runs[-1], args.hf_batch)
                    continue
                client, times = clients[side]
                runs[side].append(await measure(client, times, shifted, f"round{r}-"))
                print_path(f"round {r} {side}:", runs[side][-1])
    return runs, hf_runs, warmed_up


# ----- report


def best(runs: list[Any]) -> Any:
    return max(runs, key=lambda run: run.tok_s)


def figures(runs: dict[str, list[PathRun]], hf_runs: list[HfRun], extra: dict) -> dict:
    nats, memory = best(runs["nats"]), best(runs["memory"])
    steps = max(memory.num_steps, 1)
    hf_tok_s = best(hf_runs).tok_s if hf_runs else None
    return {
        "nats_tok_s": round(nats.tok_s, 1),
        "memory_tok_s": round(memory.tok_s, 1),
        "hf_tok_s": round(hf_tok_s, 1) if hf_tok_s else None,
        "nats_vs_memory": round(nats.tok_s / memory.tok_s, 3),
        "target_met": nats.tok_s >= 0.9 * memory.tok_s,
        "nats_vs_hf": round(nats.tok_s / hf_tok_s, 3) if hf_tok_s else None,
        "memory_vs_hf": round(memory.tok_s / hf_tok_s, 3) if hf_tok_s else None,
        "nats_bus_step_us": round(nats.bus_step_us, 1),
        "memory_bus_step_us": round(memory.bus_step_us, 1),
        "bus_added_step_us": round(nats.bus_step_us - memory.bus_step_us, 1),
        "bus_added_pct_of_step": round(
            100 * (nats.bus_step_us - memory.bus_step_us) / (1e6 * memory.seconds / steps), 2
        ),
        "nats_tok_s_rounds": [round(run.tok_s, 1) for run in runs["nats"]],
        "memory_tok_s_rounds": [round(run.tok_s, 1) for run in runs["memory"]],
        "hf_tok_s_rounds": [round(run.tok_s, 1) for run in hf_runs],
        "nats_bus_step_us_rounds": [round(run.bus_step_us) for run in runs["nats"]],
        "memory_bus_step_us_rounds": [round(run.bus_step_us) for run in runs["memory"]],
        "steps": nats.num_steps,
        "nats_step_ms": round(1e3 * nats.seconds / max(nats.num_steps, 1), 2),
        "memory_step_ms": round(1e3 * memory.seconds / max(memory.num_steps, 1), 2),
        "preemptions": sum(run.num_preemptions for path in runs.values() for run in path),
        "tokens": nats.tokens,
        **extra,
    }


def print_path(name: str, run: PathRun) -> None:
    steps = max(run.num_steps, 1)
    loop_ms = 1e3 * (run.seconds - run.step_wall_s) / steps
    print(
        f"{name:<17} {run.tokens:6d} tokens in {run.seconds:7.2f} s = {run.tok_s:8.1f} tok/s "
        f"({run.num_steps} steps; per step {1e3 * run.seconds / steps:.2f} ms = worker execute "
        f"{1e3 * run.execute_s / steps:.2f} + bus and worker shell {run.bus_step_us / 1e3:.2f} "
        f"+ engine loop {loop_ms:.2f})",
        flush=True,
    )


def print_hf(name: str, run: HfRun, batch: int) -> None:
    print(
        f"{name:<17} {run.tokens:6d} tokens in {run.seconds:7.2f} s = {run.tok_s:8.1f} tok/s "
        f"(batches of {batch}, left padded)",
        flush=True,
    )


def report(runs: dict[str, list[PathRun]], hf_runs: list[HfRun], extra: dict) -> None:
    out = figures(runs, hf_runs, extra)
    print(f"best of {extra['rounds']} round(s) after one warm-up each:")
    print_path("shoal nats:", best(runs["nats"]))
    print_path("shoal memory:", best(runs["memory"]))
    if hf_runs:
        print_hf("transformers:", best(hf_runs), extra["hf_batch"])
    verdict = "met" if out["target_met"] else "NOT met"
    print(f"nats/memory throughput: {out['nats_vs_memory']:.3f} (target >= 0.90: {verdict})")
    print(
        f"per-step cost NATS adds over the in-memory bus: {out['bus_added_step_us']:.0f} µs "
        f"({out['bus_added_pct_of_step']:.2f}% of an in-memory step)"
    )
    print(json.dumps(out))


# ----- main


def processes(args: argparse.Namespace) -> dict[str, Any]:
    """How many OS processes each side ran on, and the torch threads of each."""
    from shoal.deploy.deployment import plan_actors

    actors = len(plan_actors(engine_config(Path("."), args, "nats")))
    return {
        "nats": 1 + actors + 1,  # this process (engine client), the actors, nats-server
        "memory": 1,  # every actor in this process
        "hf": 1,  # a worker thread of this process
        "torch_threads_per_process": args.threads,
        "layout": {
            "nats": "engine client here; each planned actor (worker, engine core, recovery "
            "controller) in its own process; nats-server",
            "memory": "engine client, engine core and worker in this process",
            "hf": "generate() in a worker thread of this process",
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--batched-tokens", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="short prompts and outputs, 1 round")
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed runs per path, best kept (default 3)"
    )
    parser.add_argument("--tiny", action="store_true", help="a ~0.6M-parameter model (smoke tests)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads per process (all three systems)"
    )
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    return args


def init_torch(args: argparse.Namespace) -> None:
    """``args.threads`` torch threads here and in every actor process started later (set before
    torch loads), and ``args.device`` resolved (cuda if present)."""
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # actor processes inherit it
    import torch

    torch.set_num_threads(args.threads)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    init_torch(args)
    from bench.throughput import VOCAB, build_model, workload

    args.vocab = VOCAB
    prompts, max_tokens = workload(args.num_prompts, args.quick)
    num_blocks = blocks_needed(prompts, max_tokens, args.block_size) + len(prompts)  # + slack
    args.num_blocks = num_blocks
    print(
        f"{len(prompts)} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
        f"{sum(max_tokens)} output tokens requested, all submitted at once; engine args: "
        f"max_num_seqs={args.num_prompts} max_num_batched_tokens={args.batched_tokens} "
        f"block_size={args.block_size} num_gpu_blocks_override={num_blocks} (the whole workload "
        f"resident), prefix caching on, data/tensor parallel 1",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        model_dir = Path(tmp)
        num_params = build_model(model_dir, args.dtype, args.tiny)
        save_tokenizer(model_dir, VOCAB)
        print(
            f"model: random Llama, {num_params / 1e6:.1f}M params, {args.dtype} on "
            f"{args.device}, {args.threads} torch thread(s) per process",
            flush=True,
        )
        runs, hf_runs, warmed_up = asyncio.run(run_rounds(args, model_dir, (prompts, max_tokens)))
    extra = {
        "num_params": num_params,
        "num_prompts": len(prompts),
        "max_num_batched_tokens": args.batched_tokens,
        "num_gpu_blocks_override": num_blocks,
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "processes": processes(args),
        "hf_batch": args.hf_batch,
        "rounds": args.rounds,
        "warmed_up": warmed_up,
        "quick": args.quick,
    }
    report(runs, hf_runs, extra)


if __name__ == "__main__":
    main()
