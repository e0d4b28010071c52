"""Serving benchmark: an aiohttp load generator against a gateway, at fixed concurrency levels
and at steady request rates.

- ``--concurrency 1,8,32,64``: keep that many streaming requests in flight until the level's
  requests are done (closed loop).
- ``--request-rate 2,8``: send requests at that mean rate (per second) with Poisson arrivals
  (exponential gaps drawn from ``--seed``), whatever the server's pace (open loop), optionally
  capped at ``--max-concurrency`` in flight.

With neither flag the concurrency sweep runs; with both, the concurrency levels run first. Every
request gets its own random prompt (``--prompt-words`` words drawn from ``--seed`` and the
request's index, never repeated within a run, so the prefix cache sees no shared prefix);
``--shared-prefix-words N`` puts the same N-word prefix in front of every prompt instead (a
shared system prompt). ``--warmup-requests`` (4) go first and are not measured. Each level prints
requests/s, output tokens/s, time to first token, inter-token latency and end-to-end latency
(p50/p99), and how many requests failed (an HTTP error, an error chunk, a stream cut before
``[DONE]``, a connection error or a timeout; the first error of each kind is printed). The last
line is one JSON object: ``{"levels": [{"mode", "concurrency" | "request_rate", "req_s",
"tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p99",
"num_requests", "num_failed", "errors"}, ...], "warmup": {...}, "num_failed", "prompts",
"seed"}``. The exit status is 1 when any measured request failed.

    python bench/serve.py --url http://127.0.0.1:8000 --concurrency 1,8,32,64
    python bench/serve.py --url http://127.0.0.1:8000 --request-rate 2,8 --num-requests 64
    python bench/serve.py --launch "shoal serve --port 8000" --url http://127.0.0.1:8000

``--launch`` starts the server command first (its own process group), waits for ``/health``,
and stops it at the end. Token counts come from the stream's usage chunk; inter-token latency is
the gap between content chunks (one chunk per engine step).

``--api completions|chat|responses|messages`` (``--endpoint``) sends the same workload through
OpenAI's completions, chat completions or Responses API or Anthropic's Messages API (each
stream's text deltas and usage read in its own shape; the last two end with their final event
instead of ``[DONE]``): run it once per API to compare their throughput and TTFT.

    python bench/serve.py --url http://127.0.0.1:8000 --api responses --concurrency 1,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

_TEXT = (
    "the quick brown fox jumps over a lazy dog while small models write long stories about "
    "rivers mountains cities ships stars gardens clocks bridges islands forests letters songs "
    "maps lamps doors windows roads birds fish clouds rain snow wind fire stone glass paper "
    "silver green red blue old new early late bright quiet"
)
WORDS = _TEXT.split(" ")


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


# ----- the workload


def random_words(rng: random.Random, num_words: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(num_words)]


def make_prompt(index: int, args: argparse.Namespace) -> str:
    """Request ``index``'s prompt: its own random words, after the shared prefix if any."""
    prefix = random_words(random.Random(f"{args.seed}:prefix"), args.shared_prefix_words)
    own = random_words(random.Random(f"{args.seed}:{index}"), args.prompt_words)
    return " ".join(prefix + own)


def arrival_offsets(rate: float, num: int, seed: int) -> list[float]:
    """Seconds from the level's start at which each of ``num`` requests is sent: a Poisson
    process of ``rate`` per second (exponential gaps), the same for the same seed."""
    rng = random.Random(f"{seed}:arrivals:{rate}")
    offsets, now = [], 0.0
    for _ in range(num):
        now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


def request_body(args: argparse.Namespace, model: str, index: int) -> dict[str, object]:
    prompt = make_prompt(index, args)
    body: dict[str, object] = {
        "model": model,
        "max_tokens": args.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    elif args.endpoint == "messages":  # Anthropic's: no stream_options, usage in message_delta
        del body["stream_options"]
        body["messages"] = [{"role": "user", "content": prompt}]
    elif args.endpoint == "responses":
        del body["stream_options"], body["max_tokens"]
        body["input"] = [{"role": "user", "content": prompt}]
        body["max_output_tokens"] = args.max_tokens
    else:
        body["prompt"] = prompt
    return body


PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}
# the events that end a stream of the Responses and Messages APIs (they send no [DONE])
FINAL_EVENTS = ("response.completed", "response.incomplete", "message_stop")


# ----- one request


def content_of(chunk: dict[str, Any]) -> str:
    """The text a chunk adds, in any of the four APIs' shapes."""
    if chunk.get("type") == "response.output_text.delta":
        return str(chunk.get("delta") or "")
    if chunk.get("type") == "content_block_delta":
        return str((chunk.get("delta") or {}).get("text") or "")
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def output_tokens_of(chunk: dict[str, Any]) -> int | None:
    """The generated tokens a chunk reports, in any of the four APIs' shapes."""
    if chunk.get("usage") and "completion_tokens" in chunk["usage"]:
        return int(chunk["usage"]["completion_tokens"])
    if chunk.get("type") == "message_delta":
        return int(chunk["usage"]["output_tokens"])
    response = chunk.get("response")
    if chunk.get("type") in FINAL_EVENTS and isinstance(response, dict):
        return int(response["usage"]["output_tokens"])
    return None


async def stream_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last, done = None, False
    async with session.post(url, json=body) as response:
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            return result
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk or chunk.get("type") == "error":
                error = chunk.get("error") or chunk
                result.error = f"error chunk: {error.get('message')}"
            if (tokens := output_tokens_of(chunk)) is not None:
                result.output_tokens = tokens
            done = done or chunk.get("type") in FINAL_EVENTS
            if content_of(chunk):
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    result.e2e_s = time.perf_counter() - start
    result.ok = done and not result.error
    if not done and not result.error:
        result.error = "stream cut: no [DONE]"
    return result


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> RequestResult:
    """One streamed request; any failure (connection, timeout, bad chunk) is a failed result."""
    try:
        return await stream_request(session, url, body)
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError) as exc:
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])


# ----- levels


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile in milliseconds, rounded; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[rank], 2)


def summarize(results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    """Rates and latency percentiles over the good requests; failures counted by kind."""
    good = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    errors = Counter(r.error.split(":")[0] for r in failed)
    for kind in errors:
        example = next(r.error for r in failed if r.error.split(":")[0] == kind)
        print(f"  {errors[kind]} failed with {kind}, e.g. {example}", file=sys.stderr)
    ms = {
        "ttft": [r.ttft_s * 1000 for r in good],
        "itl": [gap * 1000 for r in good for gap in r.itl_s],
        "e2e": [r.e2e_s * 1000 for r in good],
    }
    return {
        "req_s": round(len(good) / elapsed, 3),
        "tok_s": round(sum(r.output_tokens for r in good) / elapsed, 1),
        **{f"{k}_ms_p{q}": percentile(v, q) for k, v in ms.items() for q in (50, 99)},
        "duration_s": round(elapsed, 3),
        "num_requests": len(results),
        "num_failed": len(failed),
        "errors": dict(errors),
    }


class Load:
    """Sends the run's requests; every request, warm-up included, gets a fresh prompt index."""

    def __init__(self, session: aiohttp.ClientSession, args: argparse.Namespace, model: str):
        path = PATHS[args.endpoint]
        self.session, self.args, self.model = session, args, model
        self.url = args.url.rstrip("/") + path
        self.next_index = 0

    def send(self) -> Awaitable[RequestResult]:
        body = request_body(self.args, self.model, self.next_index)
        self.next_index += 1
        return one_request(self.session, self.url, body)

    async def timed(self, run: Callable[[list[RequestResult]], Awaitable[Any]]) -> dict:
        results: list[RequestResult] = []
        start = time.perf_counter()
        await run(results)
        return summarize(results, time.perf_counter() - start)

    async def warmup(self, num: int) -> dict:
        """``num`` requests at once, not measured (first-use costs, the server's caches)."""

        async def run(results: list[RequestResult]) -> None:
            results.extend(await asyncio.gather(*(self.send() for _ in range(num))))

        return await self.timed(run)

    async def concurrency_level(self, concurrency: int) -> dict:
        """``concurrency`` clients, each sending its next request when the last one ends."""
        num = self.args.num_requests or max(
            self.args.min_requests, concurrency * self.args.requests_per_client
        )
        remaining = iter(range(num))

        async def client(results: list[RequestResult]) -> None:
            for _ in remaining:
                results.append(await self.send())

        async def run(results: list[RequestResult]) -> None:
            await asyncio.gather(*(client(results) for _ in range(concurrency)))

        return {"mode": "concurrency", "concurrency": concurrency, **await self.timed(run)}

    async def rate_level(self, rate: float) -> dict:
        """Requests sent at Poisson arrival times, whether or not earlier ones are done."""
        num = self.args.num_requests or max(self.args.min_requests, 64)
        offsets = arrival_offsets(rate, num, self.args.seed)
        cap = asyncio.Semaphore(self.args.max_concurrency or num)

        async def capped(results: list[RequestResult]) -> None:
            async with cap:
                results.append(await self.send())

        async def run(results: list[RequestResult]) -> None:
            start, tasks = time.perf_counter(), []
            for offset in offsets:
                await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
                tasks.append(asyncio.create_task(capped(results)))
            await asyncio.gather(*tasks)

        return {"mode": "rate", "request_rate": rate, **await self.timed(run)}


def print_level(level: dict) -> None:
    name = (
        f"concurrency {level['concurrency']:>3}"
        if level["mode"] == "concurrency"
        else f"rate {level['request_rate']:>6g}/s"
    )
    latencies = "  ".join(
        f"{k.upper()} p50 {level[f'{k}_ms_p50']} ms p99 {level[f'{k}_ms_p99']} ms"
        for k in ("ttft", "itl", "e2e")
    )
    print(
        f"{name}: {level['req_s']:8.2f} req/s {level['tok_s']:9.1f} tok/s  {latencies}  "
        f"({level['num_failed']} of {level['num_requests']} failed)",
        flush=True,
    )


# ----- the run


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url.rstrip("/") + "/v1/models") as response:
        response.raise_for_status()
        return str((await response.json())["data"][0]["id"])


async def wait_healthy(
    url: str, timeout_s: float, server: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if server is not None and server.poll() is not None:
                raise RuntimeError(f"the server command exited with status {server.returncode}")
            try:
                async with session.get(url.rstrip("/") + "/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s}s")


async def sweep(
    args: argparse.Namespace, server: subprocess.Popen[bytes] | None = None
) -> dict[str, Any]:
    """Warm-up, then every concurrency level, then every rate level; the JSON summary."""
    await wait_healthy(args.url, args.startup_timeout, server)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    levels = []
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout) as s:
        load = Load(s, args, args.model or await served_model(s, args.url))
        warmup = await load.warmup(args.warmup_requests)
        print(f"warm-up: {warmup['num_requests']} requests, {warmup['num_failed']} failed")
        for concurrency in args.concurrency:
            levels.append(await load.concurrency_level(concurrency))
            print_level(levels[-1])
        for rate in args.request_rate:
            levels.append(await load.rate_level(rate))
            print_level(levels[-1])
    return {
        "levels": levels,
        "warmup": {k: warmup[k] for k in ("num_requests", "num_failed", "errors")},
        "num_failed": sum(level["num_failed"] for level in levels),
        "prompts": "shared-prefix" if args.shared_prefix_words else "distinct",
        "shared_prefix_words": args.shared_prefix_words,
        "prompt_words": args.prompt_words,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
    }


def comma_list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    parser.add_argument("--model", default=None, help="model name (default: from /v1/models)")
    parser.add_argument(
        "--endpoint",
        "--api",
        choices=list(PATHS),
        default="completions",
        help="the API the load goes through (the same workload through each)",
    )
    parser.add_argument(
        "--concurrency",
        default=None,
        type=comma_list(int),
        help="comma-separated levels (default 1,8,32,64 unless --request-rate is given)",
    )
    parser.add_argument(
        "--request-rate",
        default=[],
        type=comma_list(float),
        help="comma-separated mean request rates per second (Poisson arrivals)",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="in flight at most, in rate mode"
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per level (default: concurrency x --requests-per-client, 64 per rate; "
        "at least --min-requests)",
    )
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--warmup-requests", type=int, default=4, help="sent first, not measured")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=32, help="random words per request")
    parser.add_argument(
        "--shared-prefix-words",
        type=int,
        default=0,
        help="the same random words in front of every prompt (a shared-prefix workload)",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    parser.add_argument("--api-key", default=os.environ.get("SHOAL_API_KEY"))
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--launch", default=None, help="server command to start first")
    args = parser.parse_args(argv)
    if args.concurrency is None:
        args.concurrency = [] if args.request_rate else [1, 8, 32, 64]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    if args.launch:
        server = subprocess.Popen(shlex.split(args.launch), start_new_session=True)
    try:
        summary = asyncio.run(sweep(args, server))
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    print(json.dumps(summary))
    return 0 if summary["num_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
