"""Fault tolerance on (shoal's default) against off (``--no-enable-fault-tolerance``, vLLM's
default) on a calm server: the same greedy answers, the same throughput.

Each side is ``shoal serve`` (the default model unless ``--model``) started afresh per
round, sent the same ``--num-requests`` chat requests (fixed prompts, greedy, ``--max-tokens``
each, eos ignored) ``--concurrency`` at a time; sides alternate over ``--rounds`` rounds and
each keeps its best round. Prints each side's output tokens/s and whether every answer was the
same text on both sides; the last line is one JSON object: ``on_tok_s``, ``off_tok_s``,
``ratio`` (on over off), ``outputs_equal``, ``num_requests``.

    .venv/bin/python bench/fault_default.py [--model NAME|DIR] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.serve import wait_healthy
from shoal.deploy.local import free_tcp_port

TOPICS = ("the sea", "a city at night", "bread", "rivers", "a clock", "winter", "maps", "bees")


def prompts(num: int) -> list[str]:
    return [f"Write about {TOPICS[i % len(TOPICS)]} (note {i})." for i in range(num)]


async def ask(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        return await response.json()


async def run_load(url: str, args: argparse.Namespace) -> tuple[float, list[str]]:
    """Output tokens/s and each request's text."""
    gate = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(prompt: str) -> dict:
            async with gate:
                return await ask(session, url, prompt, args.max_tokens)

        started = time.perf_counter()
        answers = await asyncio.gather(*(one(p) for p in prompts(args.num_requests)))
        elapsed = time.perf_counter() - started
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return tokens / elapsed, [a["choices"][0]["message"]["content"] for a in answers]


def serve_round(args: argparse.Namespace, fault_tolerance: bool) -> tuple[float, list[str]]:
    port = free_tcp_port()
    shoal = Path(sys.executable).parent / "shoal"
    model = [args.model] if args.model else []  # none: the default model
    command = [str(shoal), "serve", *model, "--port", str(port), *shlex.split(args.extra)]
    if not fault_tolerance:
        command.append("--no-enable-fault-tolerance")
    server = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_healthy(url, 300, server))
        asyncio.run(run_load(url, args))  # warm-up, not measured
        return asyncio.run(run_load(url, args))
    finally:
        stop(server)


def stop(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--extra", default="", help="more `shoal serve` flags for both sides")
    args = parser.parse_args(argv)
    best = {True: 0.0, False: 0.0}
    texts: dict[bool, list[str]] = {}
    for round_index in range(args.rounds):
        order = (True, False) if round_index % 2 == 0 else (False, True)
        for side in order:
            tok_s, answers = serve_round(args, side)
            best[side] = max(best[side], tok_s)
            texts.setdefault(side, answers)
            print(
                f"round {round_index} fault tolerance {'on ' if side else 'off'}: {tok_s:.1f} tok/s"
            )
    equal = texts[True] == texts[False]
    print(f"on {best[True]:.1f} tok/s, off {best[False]:.1f} tok/s, outputs equal: {equal}")
    summary = {
        "on_tok_s": round(best[True], 1),
        "off_tok_s": round(best[False], 1),
        "ratio": round(best[True] / best[False], 3),
        "outputs_equal": equal,
        "num_requests": args.num_requests,
    }
    print(json.dumps(summary))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
