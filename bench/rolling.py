"""A rolling restart of every actor under a steady load: nothing lost, goodput kept.

The deployment runs every actor as its own supervised process on an embedded nats-server:
``--data-parallel-size`` engine cores (2 by default) with a worker each, a CPU KV tier, the
recovery controller and two gateway processes; the load balancer in front of the gateways is
the client's (it sends a request to the other gateway when one refuses the connection, as
nginx's ``proxy_next_upstream error`` does). A Poisson stream of streamed greedy completions
(``--rate`` per second, fixed prompts, ``--max-tokens`` each, eos ignored) runs for
``--calm-s`` seconds, then again while ``shoal restart --rolling`` restarts every actor.

A request is lost when it fails after a gateway took it, when its usage counts other than
``--max-tokens`` tokens, or when its text differs from the same prompt's text in the calm phase
(a repeated or missing token). In float32, the default (a GGUF model dequantized to it),
greedy text does not depend on the batch (the calm phase's own disagreements are printed to
show it); the default model's quantized matmuls run in bf16, which rounds its logits to 1/8,
and a tie may break the other way in a batch of resumed requests. A request is good when it is
not lost and ends within ``--slo-factor`` times the calm phase's 90th-percentile latency; the
goodput ratio is the restart phase's share of good requests over the calm phase's (the same
offered rate: Poisson noise in the arrivals cancels). The last line is one JSON object:
``requests_lost``, ``goodput_ratio``, ``restart_s`` (median per kind), ``num_requests``,
``num_restarted``, ``all_restarted``, ``calm_disagreements``, ``total_restart_s``.

    .venv/bin/python bench/rolling.py [--model NAME|DIR] [--rate 2] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.serve import wait_healthy
from bench.throughput_e2e import start_supervised
from shoal.bus.runtime.supervisor import ActorSpec, Supervisor
from shoal.config.deployment import ShoalConfig
from shoal.deploy.deployment import GATEWAY_TARGET, build_config
from shoal.deploy.local import free_tcp_port

NAMESPACE = "rolling"
TOPICS = ("the sea", "a city at night", "bread", "rivers", "a clock", "winter", "maps", "bees")
HEARTBEAT = {"heartbeat_interval_s": 0.25}
MAX_REQUESTS = 2000  # a bound on each phase's requests, whatever the rate


@dataclass
class Deployment:
    nats_url: str
    gateway_urls: list[str]
    supervisor: Supervisor


@contextlib.asynccontextmanager
async def process_deployment(
    config: ShoalConfig, num_gateways: int = 2, ready_timeout_s: float = 300
) -> AsyncIterator[Deployment]:
    """``config``'s actors and ``num_gateways`` gateways, each its own supervised process, on a
    fresh nats-server (``bench.throughput_e2e.start_supervised``); yields once every gateway
    answers ``/health``."""
    async with contextlib.AsyncExitStack() as stack:
        bus, supervisor = await start_supervised(stack, config, actor_kwargs=HEARTBEAT)
        (nats_url,) = bus.servers
        urls = []
        for n in range(num_gateways):
            port = free_tcp_port()
            kwargs = {"actor_id": f"gateway-{n}", "config": config, "port": port, **HEARTBEAT}
            spec = ActorSpec(f"gateway-{n}", GATEWAY_TARGET, nats_url, kwargs, kind="gateway")
            supervisor.add(spec)
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            await wait_healthy(url, ready_timeout_s)
        yield Deployment(nats_url, urls, supervisor)


@dataclass
class Answer:
    prompt: str
    text: str = ""
    error: str = ""
    num_chunks: int = 0
    num_tokens: int = 0  # the completion tokens its usage counted
    first_token: float = 0.0
    started: float = 0.0
    ended: float = 0.0
    gateways_tried: list[str] = field(default_factory=list)


class FailoverClient:
    """Streams completions through any of ``urls``: a gateway that refuses the connection is
    skipped for the next (a load balancer's retry); one that took the request owns it."""

    def __init__(self, session: aiohttp.ClientSession, urls: Sequence[str], max_tokens: int):
        self.session, self.urls, self.max_tokens = session, list(urls), max_tokens
        self._next = 0

    async def complete(self, prompt: str) -> Answer:
        answer = Answer(prompt, started=time.monotonic())
        body = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        for _ in range(4 * len(self.urls)):  # bounded: each gateway a few times
            url = self.urls[self._next % len(self.urls)]
            self._next += 1
            answer.gateways_tried.append(url)
            try:
                await self._stream(url, body, answer)
                break
            except aiohttp.ClientConnectorError:
                await asyncio.sleep(0.05)  # refused: this gateway is restarting
            except (aiohttp.ClientError, ValueError) as exc:
                answer.error = f"{type(exc).__name__}: {exc}"
                break
        else:
            answer.error = "every gateway refused the connection"
        answer.ended = time.monotonic()
        return answer

    async def _stream(self, url: str, body: dict[str, Any], answer: Answer) -> None:
        async with self.session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}: {await response.text()}")
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ValueError(f"error event: {chunk['error']}")
                if chunk.get("usage"):
                    answer.num_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    answer.text += choice["text"]
                    answer.num_chunks += 1
                    answer.first_token = answer.first_token or time.monotonic()


def prompts(num: int) -> list[str]:
    return [f"Write about {TOPICS[i % len(TOPICS)]} ({i})." for i in range(num)]


async def steady_load(
    client: FailoverClient,
    texts: Sequence[str],
    rate: float,
    stop: asyncio.Event,
    *,
    seed: int = 0,
    min_requests: int = 0,
) -> list[Answer]:
    """Poisson arrivals at ``rate`` per second, cycling through ``texts``, until ``stop`` is
    set and ``min_requests`` were sent (at most ``MAX_REQUESTS``); every answer once all have
    ended."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task[Answer]] = []
    while (not stop.is_set() or len(tasks) < min_requests) and len(tasks) < MAX_REQUESTS:
        tasks.append(asyncio.create_task(client.complete(texts[len(tasks) % len(texts)])))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def rolling_restart(
    nats_url: str, namespace: str, *targets: str
) -> tuple[int, dict[str, Any]]:
    """``shoal restart --rolling --json`` as an operator runs it: its exit status and summary."""
    command = [sys.executable, "-m", "shoal.deploy.cli", "restart", "--rolling", "--json",
               "--nats-url", nats_url, "--namespace", namespace, *targets]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    lines = out.decode().splitlines()
    for line in lines[:-1]:
        print(f"  {line}", flush=True)
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    return proc.returncode or 0, summary


@dataclass
class Check:
    """What a right answer is: the calm phase's text for its prompt (fp32's greedy text does
    not depend on the batch it ran in; bf16's may) and every one of its tokens."""

    reference: dict[str, str]
    max_tokens: int
    slo_e2e_s: float = float("inf")

    def is_lost(self, answer: Answer) -> bool:
        """It failed, lacks or repeats tokens, or its text is not the calm phase's for the
        same prompt (one the calm phase never answered cannot be checked: lost too)."""
        return (
            bool(answer.error)
            or answer.num_tokens != self.max_tokens
            or answer.text != self.reference.get(answer.prompt)
        )

    def lost(self, answers: Sequence[Answer]) -> list[Answer]:
        return [a for a in answers if self.is_lost(a)]

    def good_share(self, answers: Sequence[Answer]) -> float:
        """Goodput per offered request: right and within the end-to-end latency objective."""
        good = [a for a in answers if not self.is_lost(a) and a.ended - a.started <= self.slo_e2e_s]
        return len(good) / len(answers) if answers else 0.0


def calm_check(calm: Sequence[Answer], max_tokens: int, slo_factor: float) -> tuple[Check, int]:
    """The check the calm phase sets (its first right text per prompt, an objective of
    ``slo_factor`` times its 90th-percentile latency), and how many calm answers disagree with
    it (not 0: the texts depend on batching, as bf16's can, and cannot judge a restart)."""
    answered = [a for a in calm if not a.error and a.num_tokens == max_tokens]
    reference: dict[str, str] = {}
    for answer in answered:
        reference.setdefault(answer.prompt, answer.text)
    latencies = sorted(a.ended - a.started for a in answered) or [float("inf")]
    p90 = latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))]
    check = Check(reference, max_tokens, slo_factor * p90)
    return check, len(check.lost(calm))


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    config = build_config(
        model=args.model, namespace=NAMESPACE, data_parallel_size=args.data_parallel_size,
        kv_offloading_size=args.kv_offloading_gib or None, enable_prefix_caching=True,
        max_num_seqs=args.max_num_seqs, dtype=args.dtype, dequantize=args.dtype == "float32",
    )  # fmt: skip
    texts = prompts(args.num_prompts)
    timeout = aiohttp.ClientTimeout(total=600)
    async with (
        process_deployment(config) as deployed,
        aiohttp.ClientSession(timeout=timeout) as session,
    ):
        client = FailoverClient(session, deployed.gateway_urls, args.max_tokens)
        calm_stop = asyncio.Event()
        asyncio.get_running_loop().call_later(args.calm_s, calm_stop.set)
        calm = await steady_load(client, texts, args.rate, calm_stop, min_requests=len(texts))
        check, calm_disagree = calm_check(calm, args.max_tokens, args.slo_factor)
        print(f"calm: {len(calm)} requests, {calm_disagree} disagree with the first answer to "
              f"their prompt; latency objective {check.slo_e2e_s:.2f} s", flush=True)  # fmt: skip
        stop = asyncio.Event()
        load = asyncio.create_task(steady_load(client, texts, args.rate, stop, seed=1))
        started = time.monotonic()
        status, summary = await rolling_restart(deployed.nats_url, NAMESPACE)
        restart_s = time.monotonic() - started
        stop.set()
        during = await load
    lost_answers = check.lost(during)
    for a in lost_answers[:5]:
        print(f"  lost: {a.prompt!r}: {a.error or f'{a.num_tokens} tokens, {a.text!r}'}")
    actors = summary.get("actors", [])
    restarted = {a["id"] for a in actors if a["result"] == "restarted"}
    ratio = check.good_share(during) / max(check.good_share(calm), 1e-9)
    print(f"rolling restart: exit {status}, {len(restarted)}/{len(actors)} actors restarted in "
          f"{restart_s:.1f} s; {len(during)} requests, {len(lost_answers)} lost; goodput ratio "
          f"{ratio:.3f}", flush=True)  # fmt: skip
    return {
        "requests_lost": len(lost_answers),
        "goodput_ratio": round(ratio, 3),
        "restart_s": summary.get("restart_s", {}),
        "num_requests": len(during),
        "num_restarted": len(restarted),
        "all_restarted": bool(actors) and len(restarted) == len(actors) and status == 0,
        "calm_disagreements": calm_disagree,
        "total_restart_s": round(restart_s, 1),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--calm-s", type=float, default=20.0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-offloading-gib", type=float, default=0.25)
    parser.add_argument(
        "--dtype", default="float32",
        help="float32 by default, a GGUF model's weights dequantized to it: its greedy text "
        "does not depend on the batch, so a changed text is a lost token (the quantized "
        "matmuls run in bf16, which rounds logits to 1/8 near 20: ties, broken differently "
        "in a batch of resumed requests)",
    )  # fmt: skip
    parser.add_argument(
        "--slo-factor", type=float, default=3.0,
        help="a good request ends within this many times the calm 90th-percentile latency",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = asyncio.run(bench(parse_args(argv)))
    print(json.dumps(result))
    return 0 if result["requests_lost"] == 0 and result["all_restarted"] else 1


if __name__ == "__main__":
    sys.exit(main())
