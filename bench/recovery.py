"""Fault tolerance: how fast an engine core is HEALTHY again after a fault, and how much of the
throughput survives a storm of faults.

A NATS deployment of ``--dp`` engine cores (each with its worker), every actor in its own process
under the supervisor, fault tolerance on with the recovery controller and request resumption;
the engine client in this process. Model: the built-in demo model.

1. Recovery: ``--faults`` faults one after the other, alternating an injected engine-core fault
   (``InjectFault``: it raises at its next step) and a SIGKILLed worker (the supervisor restarts
   it), round-robin over the engine cores, each under a light load. The time of one recovery is
   from the engine core's first non-READY status event to its READY one, as the client saw them
   (nobody sends ``retry`` but the controller).
2. Goodput: the same workload (``--num-requests`` greedy requests of ``--max-tokens`` tokens,
   ``--concurrency`` at once) without faults, then with an injected fault every
   ``--storm-interval-s`` seconds (round-robin over the engine cores). Goodput is the tokens of
   completed requests per second; a request counts as lost if it did not finish by its length.

Target (issue 13): HEALTHY again ≤ 5 s after an injected fault; no request lost.

    .venv/bin/python bench/recovery.py [--quick]
    shoal bench recovery [--quick]

The last line printed is one JSON object: ``recover_s_p50``, ``recover_s_p99`` (injected faults),
``kill_recover_s_p50``, ``kill_recover_s_p99`` (worker kills: they include reloading the
model), ``goodput_ratio``, ``requests_lost`` and the figures behind them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import sys
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_LEN = 16


@dataclass
class StatusLog:
    """Every engine core's status changes as it sent them: (its wall time, state) per engine.
    The sender's own timestamps, so two changes delivered together (a busy machine) still
    measure the time between them."""

    changes: dict[str, list[tuple[float, Any]]] = field(default_factory=dict)

    async def on_msg(self, msg: Any) -> None:
        from shoal.bus.codec import Codec, DecodeError
        from shoal.bus.messages.control import StatusEvent

        try:
            event = Codec(StatusEvent).decode(msg.data)
        except DecodeError:
            return
        log = self.changes.setdefault(event.actor_id, [])
        if not log or log[-1][1] != event.state:
            log.append((event.timestamp, event.state))

    def recovery_after(self, engine_id: str, since: float) -> float | None:
        """Seconds from the first non-READY state after ``since`` (wall time) to the READY
        after it."""
        from shoal.bus.messages.control import ActorState

        fault_at = None
        for at, state in sorted(self.changes.get(engine_id, []), key=lambda change: change[0]):
            if at < since:
                continue
            if fault_at is None and state is not ActorState.READY:
                fault_at = at
            elif fault_at is not None and state is ActorState.READY:
                return at - fault_at
        return None


def make_config(model_dir: Path, args: argparse.Namespace) -> Any:
    from shoal.deploy.deployment import build_config

    return build_config(
        model=str(model_dir),
        dtype="float32",
        max_model_len=PROMPT_LEN + args.max_tokens + 16,
        max_num_seqs=args.concurrency,
        num_gpu_blocks_override=args.concurrency * 8 + 32,
        data_parallel_size=args.dp,
        namespace=f"bench-recovery-{uuid.uuid4().hex[:8]}",
        fault_tolerance_config={
            "engine_recovery_timeout_sec": 60,
            "recovery_backoff_s": 0.2,
            "max_request_resumptions": 10,
        },
        worker_dead_after_s=2.0,
    )


async def open_deployment(stack: AsyncExitStack, config: Any) -> tuple[Any, Any, StatusLog]:
    """The actors as supervised processes on a fresh nats-server, a ready client here."""
    from bench.throughput_e2e import start_supervised
    from shoal.engine.client.engine_client import AsyncEngineClient

    bus, supervisor = await start_supervised(
        stack, config, actor_kwargs={"heartbeat_interval_s": 0.2}
    )
    statuses = StatusLog()
    await bus.subscribe(client_subjects(config).status("engine"), statuses.on_msg)
    client = AsyncEngineClient(bus, config)
    await client.start()
    stack.push_async_callback(client.close)
    await client.wait_until_ready(300, num_engines=config.parallel_config.data_parallel_size)
    return client, supervisor, statuses


def client_subjects(config: Any) -> Any:
    from shoal.bus.subjects import Subjects

    return Subjects(config.bus_config.namespace)


@dataclass
class Outcome:
    tokens: int = 0
    completed: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)


async def run_one(client: Any, prompt: list[int], max_tokens: int, request_id: str) -> tuple:
    from shoal.bus.messages.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    final = None
    try:
        async for output in client.generate(prompt, params, request_id):
            final = output
    except Exception as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    done = final.outputs[0] if final is not None else None
    if done is None or done.finish_reason != "length":
        return 0, f"finished {done.finish_reason if done else None}: {getattr(done, 'text', '')!r}"
    return len(done.token_ids), None


async def workload(client: Any, args: argparse.Namespace, tag: str) -> tuple[Outcome, float]:
    semaphore = asyncio.Semaphore(args.concurrency)
    outcome = Outcome()

    async def one(i: int) -> None:
        prompt = [3 + (i * 31 + j * 7) % 200 for j in range(PROMPT_LEN)]
        async with semaphore:
            tokens, error = await run_one(client, prompt, args.max_tokens, f"{tag}-{i}")
        if error is None:
            outcome.tokens += tokens
            outcome.completed += 1
        else:
            outcome.lost += 1
            outcome.errors.append(error)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(args.num_requests)))
    return outcome, time.perf_counter() - started


async def inject(client: Any, engine_id: str) -> None:
    from shoal.bus.codec import Codec
    from shoal.bus.messages.fault import EngineControlReply, InjectFault
    from shoal.bus.runtime.actor import call

    subject = client.subjects.control("engine", engine_id)
    await call(client.bus, subject, InjectFault(0), Codec(EngineControlReply), timeout=10)


async def measure_recoveries(
    client: Any, supervisor: Any, statuses: StatusLog, args: argparse.Namespace
) -> dict[str, list[float]]:
    from shoal.deploy.deployment import engine_id, worker_id

    times: dict[str, list[float]] = {"inject": [], "kill": []}
    stop = asyncio.Event()

    async def light_load() -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            prompt = [3 + (i * 13 + j) % 200 for j in range(PROMPT_LEN)]
            await asyncio.gather(
                *(run_one(client, prompt, 8, f"light-{i}-{k}") for k in range(args.dp * 2))
            )

    load = asyncio.create_task(light_load())
    try:
        for n in range(args.faults):
            rank, kind = n % args.dp, ("inject", "kill")[(n // args.dp) % 2]
            engine = engine_id(rank)
            since = time.time()
            if kind == "inject":
                await inject(client, engine)
            else:
                os.kill(supervisor.pid(worker_id(rank, 0)), signal.SIGKILL)
            deadline = time.monotonic() + 120
            while (took := statuses.recovery_after(engine, since)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{engine} not healthy again after a {kind}")
                await asyncio.sleep(0.02)
            times[kind].append(took)
            print(f"fault {n}: {kind} on {engine}: healthy again after {took:.2f} s", flush=True)
            await client.wait_until_ready(120, num_engines=args.dp)
    finally:
        stop.set()
        await load
    return times


async def storm(client: Any, args: argparse.Namespace, done: asyncio.Event) -> int:
    from shoal.deploy.deployment import engine_id

    num_faults = 0
    for n in itertools.count():
        try:
            await asyncio.wait_for(done.wait(), args.storm_interval_s)
            return num_faults
        except TimeoutError:
            pass
        try:
            await inject(client, engine_id(n % args.dp))
            num_faults += 1
        except Exception as exc:  # an engine core still recovering may not answer in time
            print(f"storm: injection {n} not armed: {exc!r}", flush=True)
    return num_faults


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from shoal.workers.demo import ensure_demo_model

    async with AsyncExitStack() as stack:
        client, supervisor, statuses = await open_deployment(
            stack, make_config(ensure_demo_model(), args)
        )
        await workload(client, argparse.Namespace(**{**vars(args), "num_requests": 4}), "warm")
        times = await measure_recoveries(client, supervisor, statuses, args)
        calm, calm_s = await workload(client, args, "calm")
        print(f"no faults: {calm.tokens} tokens in {calm_s:.2f} s, {calm.lost} lost", flush=True)
        done = asyncio.Event()
        storm_task = asyncio.create_task(storm(client, args, done))
        stormy, stormy_s = await workload(client, args, "storm")
        done.set()
        num_storm_faults = await storm_task
        print(
            f"fault storm ({num_storm_faults} faults): {stormy.tokens} tokens in "
            f"{stormy_s:.2f} s, {stormy.lost} lost {stormy.errors[:3]}",
            flush=True,
        )
    calm_tok_s, stormy_tok_s = calm.tokens / calm_s, stormy.tokens / stormy_s
    inject_s, kill_s = times["inject"], times["kill"]
    return {
        "recover_s_p50": round(percentile(inject_s, 0.5), 3),
        "recover_s_p99": round(percentile(inject_s, 0.99), 3),
        "kill_recover_s_p50": round(percentile(kill_s, 0.5), 3),
        "kill_recover_s_p99": round(percentile(kill_s, 0.99), 3),
        "goodput_ratio": round(stormy_tok_s / calm_tok_s, 3),
        "requests_lost": calm.lost + stormy.lost,
        "goodput_tok_s": {"no_faults": round(calm_tok_s, 1), "storm": round(stormy_tok_s, 1)},
        "storm_faults": num_storm_faults,
        "recover_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "recover_s_mean": round(statistics.fmean(inject_s), 3) if inject_s else None,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dp", type=int, default=2, help="engine cores")
    parser.add_argument("--faults", type=int, default=16, help="faults timed one by one")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--storm-interval-s", type=float, default=1.0)
    parser.add_argument(
        "--quick", action="store_true", help="at most 4 faults, 24 requests of 24 tokens"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.faults = min(args.faults, 4)
        args.num_requests, args.max_tokens = min(args.num_requests, 24), min(args.max_tokens, 24)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # every actor process inherits it
    print(
        f"{args.dp} engine cores, a worker each, every actor its own process over NATS; "
        f"{args.faults} timed faults; {args.num_requests} requests x {args.max_tokens} greedy "
        f"tokens, {args.concurrency} at once, calm vs a fault every {args.storm_interval_s} s",
        flush=True,
    )
    figures = asyncio.run(bench(args))
    print(
        f"recovery after an injected fault: p50 {figures['recover_s_p50']} s, p99 "
        f"{figures['recover_s_p99']} s (target <= 5 s); after a worker kill: p50 "
        f"{figures['kill_recover_s_p50']} s; goodput under the storm {figures['goodput_ratio']}x "
        f"of calm; requests lost {figures['requests_lost']} (target 0)",
        flush=True,
    )
    print(json.dumps({**figures, **{k: v for k, v in vars(args).items() if k != "quick"}}))


if __name__ == "__main__":
    main()
