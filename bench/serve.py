"""Serving benchmark: an aiohttp load generator that sweeps concurrency against a gateway.

For each concurrency level it keeps that many streaming requests in flight until the level's
requests are done, then prints requests/s, output tokens/s, time to first token and inter-token
latency (p50/p99). The last line is one JSON object:
``{"levels": [{"concurrency", "req_s", "tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50",
"itl_ms_p99"}, ...]}``.

    python bench/serve.py --url http://127.0.0.1:8000 --concurrency 1,8,32,64
    python bench/serve.py --launch "shoal serve --port 8000" --url http://127.0.0.1:8000

``--launch`` starts the server command first (its own process group), waits for ``/health``,
and stops it at the end. Token counts come from the stream's usage chunk; inter-token latency is
the gap between content chunks (one chunk per engine step).
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
from dataclasses import dataclass, field

import aiohttp

_TEXT = "the quick brown fox jumps over the lazy dog while a small model writes stories"
WORDS = _TEXT.split(" ")


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def make_prompt(index: int, num_words: int) -> str:
    return " ".join(WORDS[(index * 7 + k) % len(WORDS)] for k in range(num_words))


def request_body(args: argparse.Namespace, model: str, index: int) -> dict[str, object]:
    prompt = make_prompt(index, args.prompt_words)
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
    else:
        body["prompt"] = prompt
    return body


def content_of(chunk: dict[str, object]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:  # type: ignore[attr-defined]
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
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
                result.ok = not result.error
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = str(chunk["error"].get("message"))
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if content_of(chunk):
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    return result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


async def run_level(
    session: aiohttp.ClientSession, args: argparse.Namespace, model: str, concurrency: int
) -> dict[str, float]:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    url = args.url.rstrip("/") + path
    num_requests = max(args.min_requests, concurrency * args.requests_per_client)
    counter = iter(range(num_requests))
    results: list[RequestResult] = []

    async def client() -> None:
        for index in counter:
            results.append(await one_request(session, url, request_body(args, model, index)))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    good = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"  {len(failed)} failed, e.g. {failed[0].error}", file=sys.stderr)
    ttft = [r.ttft_s * 1000 for r in good]
    itl = [gap * 1000 for r in good for gap in r.itl_s]
    return {
        "concurrency": concurrency,
        "req_s": round(len(good) / elapsed, 3),
        "tok_s": round(sum(r.output_tokens for r in good) / elapsed, 1),
        "ttft_ms_p50": round(percentile(ttft, 50), 2),
        "ttft_ms_p99": round(percentile(ttft, 99), 2),
        "itl_ms_p50": round(percentile(itl, 50), 2),
        "itl_ms_p99": round(percentile(itl, 99), 2),
        "num_requests": len(results),
        "num_failed": len(failed),
    }


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
) -> list[dict[str, float]]:
    await wait_healthy(args.url, args.startup_timeout, server)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    levels = []
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout) as s:
        model = args.model or await served_model(s, args.url)
        for concurrency in args.concurrency:
            level = await run_level(s, args, model, concurrency)
            levels.append(level)
            print(
                f"concurrency {concurrency:>3}: {level['req_s']:8.2f} req/s "
                f"{level['tok_s']:9.1f} tok/s  TTFT p50 {level['ttft_ms_p50']:8.2f} ms "
                f"p99 {level['ttft_ms_p99']:8.2f} ms  ITL p50 {level['itl_ms_p50']:7.2f} ms "
                f"p99 {level['itl_ms_p99']:7.2f} ms  ({level['num_failed']} failed)",
                flush=True,
            )
    return levels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    parser.add_argument("--model", default=None, help="model name (default: from /v1/models)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument(
        "--concurrency",
        default="1,8,32,64",
        type=lambda text: [int(x) for x in text.split(",")],
        help="comma-separated levels",
    )
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--api-key", default=os.environ.get("SHOAL_API_KEY"))
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--launch", default=None, help="server command to start first")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    if args.launch:
        server = subprocess.Popen(shlex.split(args.launch), start_new_session=True)
    try:
        levels = asyncio.run(sweep(args, server))
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    summary = [{k: v for k, v in level.items() if not k.startswith("num_")} for level in levels]
    print(json.dumps({"levels": summary}))
    return 0 if all(level["num_failed"] == 0 for level in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
