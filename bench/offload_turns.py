"""The returning turns of ``bench/offload.py``, in every mode: two conversations, A and B,
whose first turns run, then returning turns alternating A, B, ... on a worker pool that holds
one of them (each turn evicts the other's prefix from the local prefix cache).

- ``recompute``: offload off.
- ``cpu``: a CPU tier holding both conversations.
- ``fs`` / ``obj``: a CPU tier holding one prefix in front of a filesystem / object-store tier
  (the other conversation evicted it from the CPU tier: it is promoted, then loaded). ``obj``
  runs on a NATS server (the JetStream Object Store).
- ``p2p``: two hosts of one deployment on a NATS server. The first turns run on host A, a
  process of its own (``bench/offload_host.py``; its CPU tier keeps both conversations), then
  A's engine core goes and the returning turns run on host B, here, whose CPU tier holds one
  prefix: each return is looked up in A's CPU tier through the p2p tiers, streamed from A's
  region into B's over TCP on loopback, and loaded. B first serves one unrelated turn of the
  prefix's length (not measured), as the other modes' engine served the first turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import sys
import uuid
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from bench.offload_engine import (
    BLOCK_SIZE,
    Engine,
    Model,
    blocks_for,
    offload_options,
    open_engine,
    random_tokens,
    stats,
    turn,
)

MODES = ("recompute", "cpu", "fs", "obj", "p2p")
NATS_MODES = ("obj", "p2p")
HOST_A_TIMEOUT_S = 600.0  # host A's start and first turns


def turn_tokens(args: Any) -> int:
    return int(args.prefix_tokens + 2 * args.max_tokens + args.follow_up_tokens)


def mode_options(model: Model, args: Any, mode: str, host: str = "") -> dict[str, Any]:
    """A worker pool of one returning turn and the mode's tiers (``host``: p2p's ``a`` or
    ``b``)."""
    turn_blocks = blocks_for(turn_tokens(args))
    options: dict[str, Any] = {"num_gpu_blocks_override": turn_blocks + 1}
    prefix_chunks = args.prefix_tokens // BLOCK_SIZE
    tier_bytes = 4 * turn_blocks * model.chunk_bytes
    if mode == "cpu":
        options |= offload_options(model, 2 * turn_blocks + 8)
    elif mode == "fs":
        path = Path(args.fs_path) / f"fs-{uuid.uuid4().hex[:8]}"
        fs = {"type": "fs", "path": str(path), "bytes_to_use": tier_bytes}
        options |= offload_options(model, prefix_chunks, secondary_tiers=[fs])
    elif mode == "obj":
        obj = {"type": "obj", "bucket": f"bench_{uuid.uuid4().hex[:8]}", "bytes_to_use": tier_bytes}
        options |= offload_options(model, prefix_chunks, secondary_tiers=[obj])
    elif mode == "p2p":  # A keeps both conversations, B one prefix
        chunks = 2 * turn_blocks + 8 if host == "a" else prefix_chunks
        p2p = {"type": "p2p", "peer_lookup_timeout_s": 0.5, "read_timeout_s": 10.0}
        p2p["data_host"] = "127.0.0.1"  # its direct stream: both hosts are this one
        options |= offload_options(model, chunks, secondary_tiers=[p2p], cpu_tier_id=f"kv-{host}")
    return options


async def returning_turns(
    model: Model, args: Any, mode: str, nats_url: str | None = None
) -> dict[str, Any]:
    """Both first turns, then the returning turns alternating; their TTFTs, tokens, stats."""
    rng = random.Random(args.seed)
    firsts = [random_tokens(rng, args.prefix_tokens) for _ in range(2)]
    follow_ups = [random_tokens(rng, args.follow_up_tokens) for _ in range(args.returns)]
    url = nats_url if mode in NATS_MODES else None
    namespace = f"bench-offload-{uuid.uuid4().hex[:8]}"
    async with AsyncExitStack() as stack:
        if mode == "p2p":  # first turns on host A (another process), the returns on B (here)
            host_a = mode_options(model, args, mode, "a")
            answers = await stack.enter_async_context(
                host_in_a_process(model, args, url, namespace, host_a, firsts)
            )
            options = mode_options(model, args, mode, "b")
            engine = await open_engine(stack, model, args, url, namespace, **options)
            # B has served before, as the one-host modes' engine has (their first turns): an
            # unrelated turn of the prefix's length, so no measured return is the first to touch
            # B's KV cache and region pages (the first return took 0.05-0.3 s longer without).
            warm_up = random_tokens(random.Random(args.seed + 1), args.prefix_tokens)
            await turn(engine, warm_up, 1, "warm-up")
        else:
            options = mode_options(model, args, mode)
            engine = await open_engine(stack, model, args, url, namespace, **options)
            answers = []
            for i, first in enumerate(firsts):
                done = await turn(engine, first, args.max_tokens, f"first-{i}")
                answers.append(done.token_ids)
        before = stats(engine)
        returns = []
        for n, follow_up in enumerate(follow_ups):
            prompt = [*firsts[n % 2], *answers[n % 2], *follow_up]
            returns.append(await turn(engine, prompt, args.max_tokens, f"return-{n}"))
        after = stats(engine)
        tiers = {name: tier.load() for name, tier in engine.tiers.items()}
    return figures(model, returns, before, after, tiers)


def figures(
    model: Model, returns: list[Any], before: Any, after: Any, tiers: dict[str, dict[str, float]]
) -> dict[str, Any]:
    """TTFTs, tokens and loads of the returning turns; the promotion bandwidth of the
    secondary tier (chunk bytes read into the CPU tier per second of the secondary's reads)."""
    ttfts = [r.ttft_s * 1000 for r in returns]
    load_s = after.kv_offload_load_time_s - before.kv_offload_load_time_s
    load_bytes = after.kv_offload_load_bytes - before.kv_offload_load_bytes
    cpu = tiers.get("CpuTierActor", {})
    promoted = int(cpu.get("num_promoted", 0))
    promote_s = cpu.get("promote_time_s", 0.0)
    return {
        "ttft_ms": statistics.fmean(ttfts),
        "ttft_ms_each": [round(t, 1) for t in ttfts],
        "outputs": [r.token_ids for r in returns],
        "cached_tokens": [r.num_cached_tokens for r in returns],
        "hit_tokens": after.kv_offload_hits - before.kv_offload_hits,
        "load_bytes": load_bytes,
        "load_gbps": load_bytes / load_s / 1e9 if load_s > 0 else None,
        "promoted_chunks": promoted,
        "promote_gbps": promoted * model.chunk_bytes / promote_s / 1e9 if promote_s else None,
        "cascade_dropped_chunks": int(cpu.get("num_cascade_dropped", 0)),
    }


__all__ = ["MODES", "NATS_MODES", "Engine", "returning_turns"]


@contextlib.asynccontextmanager
async def host_in_a_process(
    model: Model,
    args: Any,
    nats_url: str | None,
    namespace: str,
    options: dict[str, Any],
    prompts: list[list[int]],
) -> AsyncIterator[list[list[int]]]:
    """``bench/offload_host.py`` running the first turns on host A; their answers. Host A's
    tiers serve its peers until the context ends."""
    job = {
        "model": str(model.path),
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "nats_url": nats_url,
        "namespace": namespace,
        "device": args.device,
        "max_model_len": args.max_model_len,
        "max_tokens": args.max_tokens,
        "options": options,
        "prompts": prompts,
    }
    script = Path(__file__).with_name("offload_host.py")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdin=PIPE, stdout=PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(job).encode() + b"\n")
        await proc.stdin.drain()
        line = await asyncio.wait_for(proc.stdout.readline(), HOST_A_TIMEOUT_S)
        if not line:
            raise RuntimeError(f"host A exited ({await proc.wait()}) before answering")
        yield json.loads(line)["answers"]
    finally:
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
