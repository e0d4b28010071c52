"""Request/reply round trip (p50/p99) and pipelined messages/s for 200-byte and 64 KiB payloads
over (a) raw nats-py, (b) shoal's NatsBus, (c) the in-memory bus, in one process against a local
nats-server. Rounds interleave the transports so machine noise hits them alike.

    .venv/bin/python bench/bus.py [--rounds 3] [--requests 1000]

The last line is one JSON object: ``rtt_us_p50`` per transport at 200 bytes, ``ratio_vs_raw``
(shoal's NATS p50 over raw nats-py's) and per-size ``detail``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats

from shoal.bus.errors import NoRespondersError
from shoal.bus.msg import Msg
from shoal.bus.nats_ops.server import NatsServer
from shoal.bus.transport.memory import InMemoryBus
from shoal.bus.transport.nats_bus import NatsBus

SUBJECT = "bench.echo"
SIZES = (200, 64 * 1024)
CONCURRENCY = 32
Request = Callable[[bytes], Awaitable[bytes]]


async def raw_nats(url: str) -> tuple[Request, Callable[[], Awaitable[None]]]:
    responder, client = await nats.connect(url), await nats.connect(url)

    async def echo(msg) -> None:  # type: ignore[no-untyped-def]
        await responder.publish(msg.reply, msg.data)

    await responder.subscribe(SUBJECT, cb=echo)
    await responder.flush()

    async def request(data: bytes) -> bytes:
        return (await client.request(SUBJECT, data, timeout=5)).data

    async def close() -> None:
        await client.close()
        await responder.close()

    return request, close


async def shoal_bus(responder, client) -> tuple[Request, Callable[[], Awaitable[None]]]:  # type: ignore[no-untyped-def]
    await responder.connect()
    await client.connect()

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    await responder.subscribe(SUBJECT, echo)
    await responder.flush()

    async def request(data: bytes) -> bytes:
        return (await client.request(SUBJECT, data, timeout=5)).data

    async def close() -> None:
        await client.close()
        await responder.close()

    return request, close


async def warm_up(request: Request, payload: bytes) -> None:
    for attempt in range(100):  # bounded: the responder's interest may still be propagating
        try:
            await request(payload)
            return
        except NoRespondersError:
            await asyncio.sleep(0.01 * (attempt + 1))
    await request(payload)


async def round_trips(request: Request, payload: bytes, count: int) -> list[float]:
    rtts = []
    for _ in range(count):
        start = time.perf_counter()
        await request(payload)
        rtts.append(time.perf_counter() - start)
    return rtts


async def pipelined_rate(request: Request, payload: bytes, count: int) -> float:
    per_worker = max(1, count // CONCURRENCY)

    async def worker() -> None:
        for _ in range(per_worker):
            await request(payload)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return per_worker * CONCURRENCY / (time.perf_counter() - start)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def open_transports(url: str) -> dict[str, tuple[Request, Callable[[], Awaitable[None]]]]:
    return {
        "raw_nats": await raw_nats(url),
        "shoal_nats": await shoal_bus(NatsBus([url]), NatsBus([url])),
        "memory": await shoal_bus(*_memory_pair()),
    }


async def run(rounds: int, num_requests: int) -> dict[str, object]:
    """Batches of sequential round trips alternate between transports (fair under noise)."""
    samples: dict[tuple[str, int], list[float]] = {}
    rates: dict[tuple[str, int], list[float]] = {}
    with NatsServer(max_payload=8 << 20) as server:
        transports = await open_transports(server.url)
        for size in SIZES:
            payload = b"x" * size
            count = num_requests if size <= 1024 else max(100, num_requests // 4)
            for request, _ in transports.values():
                await warm_up(request, payload)
                await round_trips(request, payload, min(100, count))
            for _ in range(rounds):
                for _ in range(10):
                    for name, (request, _) in transports.items():
                        rtts = await round_trips(request, payload, count // 10)
                        samples.setdefault((name, size), []).extend(rtts)
                for name, (request, _) in transports.items():
                    rate = await pipelined_rate(request, payload, count)
                    rates.setdefault((name, size), []).append(rate)
        for _, close in transports.values():
            await close()
    return summarize(samples, rates)


def summarize(
    samples: dict[tuple[str, int], list[float]], rates: dict[tuple[str, int], list[float]]
) -> dict[str, object]:
    detail: dict[str, dict[str, dict[str, float]]] = {}
    for (name, size), rtts in samples.items():
        detail.setdefault(str(size), {})[name] = {
            "rtt_us_p50": round(statistics.median(rtts) * 1e6, 1),
            "rtt_us_p99": round(percentile(rtts, 0.99) * 1e6, 1),
            "msgs_per_s": round(statistics.median(rates[(name, size)])),
        }
    p50 = {name: figures["rtt_us_p50"] for name, figures in detail[str(SIZES[0])].items()}
    big = {name: figures["rtt_us_p50"] for name, figures in detail[str(SIZES[1])].items()}
    return {
        "rtt_us_p50": p50,
        "ratio_vs_raw": round(p50["shoal_nats"] / p50["raw_nats"], 3),
        "ratio_vs_raw_64k": round(big["shoal_nats"] / big["raw_nats"], 3),
        "detail": detail,
    }


def _memory_pair() -> tuple[InMemoryBus, InMemoryBus]:
    responder = InMemoryBus()
    return responder, responder.sibling()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1000, help="per round, 200-byte size")
    args = parser.parse_args()
    result = asyncio.run(run(args.rounds, args.requests))
    for size, by_transport in result["detail"].items():  # type: ignore[attr-defined]
        for name, figures in by_transport.items():
            print(
                f"{int(size):>6} B  {name:<10}  p50 {figures['rtt_us_p50']:>8.1f} us  "
                f"p99 {figures['rtt_us_p99']:>8.1f} us  {figures['msgs_per_s']:>8} msg/s"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
